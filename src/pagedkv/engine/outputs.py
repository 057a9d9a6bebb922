"""What the engine hands back: one `RequestOutput` per request per step, with its n completions."""

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
    finish_reason: str | None = None  # "stop", "length", "abort", "rejected"
    logprobs: list[TokenLogprobs] | None = None  # one per token, when SamplingParams.logprobs is set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step. `finished` once every completion has a finish reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request was rejected
    metrics: dict = field(default_factory=dict)  # arrival, first_token and finish times (perf_counter s)
