"""What the engine hands back: one `RequestOutput` per request per step (with its n completions), its stats
and, when asked, where each step's time went."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """One sampled token's log-probability and the `top` most likely tokens (most likely first).

    Log-probabilities are the model's own distribution (log_softmax of the raw logits), before
    penalties, logit_bias, temperature, top-k and top-p, as vLLM reports them by default.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One of a request's n continuations."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "rejected", "error"
    logprobs: list[TokenLogprobs] | None = None  # one per token, when SamplingParams.logprobs is set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestOutput:
    """A request's state after a step. `finished` once every completion has a finish reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # why it was rejected (finish reason "rejected") or failed ("error")
    metrics: dict = field(default_factory=dict)  # arrival, first_token and finish times (perf_counter s)


#: `StepTiming`'s phases, in step order (the field names).
STEP_PHASES = ("schedule_s", "build_s", "launch_s", "wait_s", "update_s")


@dataclass(frozen=True)
class StepTiming:
    """Where one step's wall time went (seconds). Only `wait_s` overlaps the device's work."""

    shape: object  # the step's StepShape
    schedule_s: float
    build_s: float  # SchedulerOutput -> StepInput
    launch_s: float  # staging copy, block moves, graph replay or eager kernel launches, sampler launch
    wait_s: float  # waiting for the sampled tokens (device time not yet covered by the host)
    update_s: float  # scheduler update, detokenization, outputs

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.build_s + self.launch_s + self.wait_s + self.update_s


@dataclass
class EngineStats:
    """What `stats()` reports."""

    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    peak_used_blocks: int
    num_preemptions: int
    num_swap_outs: int
    num_swap_ins: int
    num_rejected: int
    num_request_failures: int  # requests that failed alone inside the engine; their step-mates went on
    prefix_cache_queries: int  # blocks looked up
    prefix_cache_hits: int  # blocks found
    prefix_cache_hit_tokens: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int
    busy_seconds: float
    # KV tiers (all 0 without a host pool): prefix blocks served per tier, blocks and bytes moved, and
    # the time the copies took (device time on CUDA; wall time of the reads for disk)
    kv_gpu_hit_blocks: int = 0
    kv_host_hit_blocks: int = 0
    kv_disk_hit_blocks: int = 0
    kv_offloaded_blocks: int = 0  # spilled GPU -> host
    kv_restored_blocks: int = 0  # host -> GPU (host and disk hits)
    kv_disk_loaded_blocks: int = 0
    kv_disk_load_misses: int = 0  # files indexed but missing, torn, corrupt or from another config
    kv_disk_written_blocks: int = 0
    kv_host_blocks: int = 0
    kv_host_cached_blocks: int = 0
    kv_disk_blocks: int = 0
    kv_d2h_bytes: int = 0
    kv_d2h_seconds: float = 0.0
    kv_h2d_bytes: int = 0
    kv_h2d_seconds: float = 0.0  # staged copies plus the scatter into the pool's layout
    kv_h2d_copy_seconds: float = 0.0  # the pinned host -> device copies alone
    kv_h2d_num_copies: int = 0  # host -> device copies (one per run of consecutive host blocks)
    kv_disk_read_bytes: int = 0
    kv_disk_read_seconds: float = 0.0
    kv_disk_write_bytes: int = 0
    kv_disk_write_waits: int = 0  # host blocks a step waited for to finish their disk write before reusing them
    kv_disk_write_wait_seconds: float = 0.0  # the steps' time in those waits

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of time spent in `step()`."""
        return self.num_generated_tokens / self.busy_seconds if self.busy_seconds else 0.0

    def as_dict(self) -> dict:
        data = dict(self.__dict__)
        data["tokens_per_second"] = self.tokens_per_second
        return data
