"""What the scheduler is configured with and what it hands out: its config and policies, and one step's output.

`SchedulerConfig` (frozen, validated) holds the pool's size and the step's limits; `PreemptionMode`
and `VictimPolicy` name what happens when the pool runs short. Each `Scheduler.schedule()` returns a
`SchedulerOutput`: the `ScheduledSequence`s of the step (decodes first, then prefill chunks), the
block copies the runner must make before its kernels, and the step's `StepShape`, the few numbers
the simulator's cost model and the engine's step timings read. Pure Python, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedkv.core.block_table import BlockCopy, num_blocks_for
from pagedkv.core.kv_groups import KVLayout
from pagedkv.core.kv_tiers import TierCopies
from pagedkv.engine.sequence import Sequence
from pagedkv.errors import ConfigError, require_positive_int


class PreemptionMode(str, enum.Enum):
    """What happens to a victim's KV: thrown away and recomputed later, or copied to CPU."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


class VictimPolicy(str, enum.Enum):
    """Which running sequence gives up its blocks when the pool runs short."""

    NEWEST = "newest"  # the most recently admitted request
    PRIORITY = "priority"  # the lowest `priority` (ties: newest)
    CHEAPEST = "cheapest"  # the fewest computed tokens, i.e. the least work lost (ties: newest)
    REQUESTER = "requester"  # whichever sequence fails to get a block (PageFault's undeliberate choice)


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits and policies. `reservation="naive"` reserves max_model_len per sequence."""

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    victim_policy: VictimPolicy = VictimPolicy.NEWEST
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_swap_blocks: int = 0
    reservation: str = "paged"
    kv_layout: KVLayout | None = None  # layer groups; None or no sliding group: one table per sequence
    num_offload_blocks: int = 0  # host blocks of the KV tiers' host tier (beside the swap blocks)
    disk_capacity_blocks: int = 0  # blocks the disk tier may hold (0: no disk tier)
    # tokens' worth of restored blocks copied before a step's kernels (None: max_num_batched_tokens); see kv_offload
    max_in_step_restore_tokens: int | None = None
    kv_write_through: bool = False  # copy committed blocks to the host tier ahead of eviction (see pool_queries)

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            require_positive_int(name, getattr(self, name))
        for name in ("num_swap_blocks", "num_offload_blocks", "disk_capacity_blocks"):
            require_positive_int(name, getattr(self, name), allow_zero=True)
        if self.max_in_step_restore_tokens is not None:
            require_positive_int("max_in_step_restore_tokens", self.max_in_step_restore_tokens, allow_zero=True)
        if self.disk_capacity_blocks and not self.num_offload_blocks:
            raise ConfigError("a disk tier (disk_capacity_blocks > 0) needs a host tier to stage through "
                              "(num_offload_blocks > 0)")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        object.__setattr__(self, "preemption_mode", _parse_enum(PreemptionMode, self.preemption_mode, "preemption_mode"))
        object.__setattr__(self, "victim_policy", _parse_enum(VictimPolicy, self.victim_policy, "victim_policy"))
        if self.reservation not in ("paged", "naive"):
            raise ConfigError(f"reservation must be 'paged' or 'naive', got {self.reservation!r}")
        if self.preemption_mode is PreemptionMode.SWAP and self.num_swap_blocks == 0:
            raise ConfigError("preemption_mode 'swap' needs num_swap_blocks > 0 (CPU swap space)")
        if self.has_windows and self.reservation == "naive":
            raise ConfigError("reservation 'naive' reserves one full-length table per sequence; a model with "
                              "sliding-window layers is served paged only")

    @property
    def has_windows(self) -> bool:
        """Whether some layer group slides (then the hybrid block manager keeps a table per group)."""
        return self.kv_layout is not None and self.kv_layout.is_hybrid

    def blocks_for_request(self, num_tokens: int) -> int:
        """The most pool blocks one request of `num_tokens` tokens holds at once."""
        if not self.has_windows:
            return num_blocks_for(num_tokens, self.block_size)
        return self.kv_layout.max_blocks_per_seq(num_tokens, self.block_size,
                                                 min(num_tokens, self.max_num_batched_tokens))

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size


def _parse_enum(kind: type[enum.Enum], value: object, name: str):
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise ConfigError(f"{name} must be one of {choices}; got {value!r}") from None


@dataclass
class ScheduledSequence:
    """A sequence's share of one step: tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the last token, so the step samples a new one."""
        return self.end == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One query token (a decode, or a prefill's last chunk of one token)."""
        return self.num_new_tokens == 1


@dataclass(frozen=True)
class StepShape:
    """What a step costs, in the three numbers its time depends on (the simulator's cost model and the
    engine benchmark's calibration both read this one definition)."""

    prefill_tokens: int  # tokens of chunks with more than one query token
    decode_seqs: int  # sequences with exactly one query token
    kv_tokens: int  # K/V tokens attention reads: every scheduled sequence's length after the step
    swapped_blocks: int = 0  # blocks copied between the device and host swap space
    offloaded_blocks: int = 0  # blocks the GPU prefix cache spilled to the host tier (device -> host)
    restored_blocks: int = 0  # prefix hits copied back from the host tier (host -> device, beside the step)
    pre_spilled_blocks: int = 0  # cached blocks copied to the host ahead of their eviction (beside the step)
    restored_in_step_blocks: int = 0  # prefix hits copied back before the step's kernels (host -> device)


@dataclass
class SchedulerOutput:
    """Everything the runner must do for one step, in order: swaps, copies, then the model."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[BlockCopy] = field(default_factory=list)  # GPU block -> CPU block
    swap_in: list[BlockCopy] = field(default_factory=list)  # CPU block -> GPU block
    block_copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write, GPU -> GPU
    preempted: list[Sequence] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)  # children created by update() (n > 1)
    failed: dict[str, BaseException] = field(default_factory=dict)  # request id -> why resolve failed it
    tier_copies: TierCopies = field(default_factory=TierCopies)  # KV tiers: spills, restores, disk I/O

    @property
    def shape(self) -> StepShape:
        prefill = decode = kv = 0
        for item in self.scheduled:
            if item.num_new_tokens == 1:
                decode += 1
            else:
                prefill += item.num_new_tokens
            kv += item.start + item.num_new_tokens
        tiers = self.tier_copies
        return StepShape(prefill, decode, kv, len(self.swap_out) + len(self.swap_in), len(tiers.offload),
                         len(tiers.restore), len(tiers.pre_offload), len(tiers.restore_in_step))

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters since construction."""

    num_preemptions: int = 0
    num_recomputes: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_rejected: int = 0  # refused by add() as never fitting
    num_steps: int = 0
