"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.memory import check_kv_cache_dtype
from pagedkv.errors import ConfigError, require_positive_int

#: How steps with prefill tokens use CUDA graphs (see `EngineConfig.mixed_step_graphs`).
MIXED_STEP_GRAPHS = ("full", "piecewise", "off")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs and how.

    kv_cache_memory: the KV pool's budget. An int is bytes; a float in (0, 1] is a fraction
    of the device memory that is free once the model is loaded (CUDA), or of 1 GiB on CPU.
    None means 0.5 on CUDA and 256 MiB on CPU. `num_blocks` overrides it with an exact count.

    max_model_len: the longest sequence (prompt + output). None: the model's limit, capped
    at what the pool holds. Given explicitly, startup fails if one such sequence cannot fit.

    kv_cache_dtype: what the pool stores: "auto" (the model's dtype) or "fp8_e4m3" /
    "fp8_e5m2" (one byte per value, so the same budget holds twice the bf16 blocks; scales
    from the checkpoint or a startup calibration pass, see `pagedkv.hf.kv_scales`).

    kv_offload_memory: bytes of (pinned) host memory for the KV tiers' host tier: prefixes the
    GPU prefix cache evicts spill there and come back with a copy instead of a prefill. 0: off.
    kv_offload_dir: a directory for the disk tier behind it (needs kv_offload_memory), which
    a restarted engine finds again; kv_offload_disk_bytes caps its size (LRU beyond it).
    kv_offload_in_step_restore_tokens: how many tokens' worth of restored blocks a step copies
    before its kernels, their requests computing in that step (None: max_num_batched_tokens); the
    rest are copied beside the step, their requests computing from the next one.
    kv_offload_disk_writes_during_steps: let the disk tier's writer threads start writes while the
    step loop schedules, builds and launches (False, the default: only while it waits for the device
    and between steps, where they do not take the interpreter lock from it). See docs/kv-tiers.md.
    kv_offload_disk_writer: "threads" (default) or "process": the disk tier's writes in a child process
    over a host pool in shared memory, so they never take this process's interpreter lock
    (`pagedkv.engine.kv_disk_process`; threads again, with a warning, where /dev/shm cannot hold the pool).
    kv_offload_early_restore: start copying a restore's host blocks to the device as soon as the scheduler has
    chosen them, before it evicts and allocates their GPU blocks (default on; False issues them with the step's
    other block moves; ignored under tensor parallelism, where every rank copies its own shard with the step).
    kv_offload_write_through: copy each prefix block to the host tier as soon as its KV is computed (up to 128
    blocks a step, beside the steps, into free host blocks only), so that its eviction later needs no copy; off
    by default (experimental: not yet measured on a GPU).
    """

    model: str | None = None
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    device: str | None = None  # None: cuda if available, else cpu
    block_size: int = 16
    kv_cache_memory: int | float | None = None
    num_blocks: int | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    # Sliding-window models: a block table per layer group, sliding groups keeping only their window
    # (`pagedkv.core.kv_groups`). False: every layer keeps every token in one table, as for other models.
    hybrid_kv: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    preemption_mode: str = "recompute"
    victim_policy: str = "newest"
    swap_space: int = 256 * 2**20  # bytes of CPU memory for swapped-out blocks (swap mode)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    model_impl: str = "auto"  # "auto": pagedkv's own decoder where it covers the family, else HF modules
    enforce_eager: bool = False  # True: no CUDA graphs at all
    # Steps with prefill tokens (own decoders, CUDA), per token bucket: "full" replays one graph with the
    # unified attention kernel inside; "piecewise" replays graphs of everything but attention, which runs
    # eagerly between them; "off" runs them eagerly. Decode-only steps replay decode graphs unless enforce_eager.
    mixed_step_graphs: str = "full"
    # Schedule and launch step k+1 while the device runs step k (its tokens feed k+1 on the device).
    # Requests with n > 1 or penalties run without overlap while they are live.
    async_scheduling: bool = True
    tensor_parallel_size: int = 1  # ranks that split heads and MLP width (NCCL on GPUs, gloo on CPU)
    distributed_timeout_s: float = 120.0  # a collective that waits longer fails the engine
    kv_offload_memory: int = 0  # bytes of host memory for the KV tiers' host tier (0: no host tier)
    kv_offload_dir: str | None = None  # the disk tier's directory (None: no disk tier)
    kv_offload_disk_bytes: int = 64 * 2**30  # the disk tier's size cap
    kv_offload_in_step_restore_tokens: int | None = None  # None: max_num_batched_tokens
    kv_offload_disk_writes_during_steps: bool = False
    kv_offload_disk_writer: str = "threads"  # or "process"
    kv_offload_early_restore: bool = True  # start a restore's copies at admission (one rank; see kv_offload)
    kv_offload_write_through: bool = False  # copy committed blocks to the host ahead of eviction

    def __post_init__(self):
        require_positive_int("block_size", self.block_size)
        require_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        require_positive_int("max_num_seqs", self.max_num_seqs)
        require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        require_positive_int("swap_space", self.swap_space, allow_zero=True)
        check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("kv_offload_memory", "kv_offload_disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a number of bytes >= 0 (such as 4 * 2**30), got {value!r}")
        tokens = self.kv_offload_in_step_restore_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise ConfigError(f"kv_offload_in_step_restore_tokens must be a number of tokens >= 0 (or None: "
                              f"max_num_batched_tokens), got {tokens!r}")
        for name in ("kv_offload_early_restore", "kv_offload_write_through"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_offload_disk_writer not in ("threads", "process"):
            raise ConfigError(f"kv_offload_disk_writer must be 'threads' or 'process', got "
                              f"{self.kv_offload_disk_writer!r}")
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir:
                raise ConfigError(f"kv_offload_dir must be a directory path, got {self.kv_offload_dir!r}")
            if not self.kv_offload_memory:
                raise ConfigError(f"kv_offload_dir {self.kv_offload_dir!r} needs a host tier to stage blocks "
                                  "through: set kv_offload_memory (--kv-offload-memory) > 0")
            if not self.enable_prefix_caching:
                raise ConfigError("kv_offload_dir keeps prefix-cache blocks: it needs enable_prefix_caching")
        if self.num_blocks is not None:
            require_positive_int("num_blocks", self.num_blocks)
        if self.max_model_len is not None:
            require_positive_int("max_model_len", self.max_model_len)
        memory = self.kv_cache_memory
        if memory is not None:
            if isinstance(memory, bool) or not isinstance(memory, (int, float)):
                raise ConfigError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {memory!r}")
            if isinstance(memory, float) and not 0.0 < memory <= 1.0:
                raise ConfigError(f"kv_cache_memory as a fraction must be in (0, 1], got {memory}")
            if isinstance(memory, int) and memory <= 0:
                raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {memory}")
        if self.mixed_step_graphs not in MIXED_STEP_GRAPHS:
            raise ConfigError(f"mixed_step_graphs must be one of {', '.join(MIXED_STEP_GRAPHS)}, "
                              f"got {self.mixed_step_graphs!r}")
        if self.model_impl not in ("auto", "pagedkv", "hf"):
            raise ConfigError(f"model_impl must be 'auto', 'pagedkv' or 'hf', got {self.model_impl!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
