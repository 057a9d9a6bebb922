"""Capacity: how many sequences a KV budget holds, reserved naively or paged.

    naive   every sequence reserves max_len tokens up front       budget // (max_len * bytes/token)
    paged   every sequence holds whole blocks of what it stored   budget // (ceil(mean_len / B) * B * bytes/token)

The paged count assumes the mean length holds across the batch. For sliding-window layers
both sides are capped at the window (see `KVSizing.seq_kv_bytes` / `paged_seq_kv_bytes`).
Each `*_formulas` function returns the formulas it used with the numbers put in, so the CLI
can print them and `--json` can carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.calc.sizing import KVSizing
from pagedkv.core import MemoryReport, ModelSpec, memory_report, num_blocks_for
from pagedkv.errors import InvalidArgumentError, require_positive_int

GB = 10**9
MB = 10**6

#: PageFault's kernel layout, used when no model is named: K and V of one head of 64 fp32 values
#: (2 * 64 * 4 = 512 B/token), so the workload's MB compare directly with PageFault's.
TOY_SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype_bytes=4,
                     name="PageFault's toy layout (1 layer, 1 KV head, head_dim 64, fp32)")

#: The block sizes of the page-size trade-off table.
SWEEP_BLOCK_SIZES = (1, 16, 64, 256)


def format_bytes(num_bytes: int | float) -> str:
    """Bytes in decimal units (GB = 1e9, MB = 1e6), exact below 1 MB."""
    if num_bytes >= GB:
        return f"{num_bytes / GB:,.2f} GB"
    if num_bytes >= MB:
        return f"{num_bytes / MB:,.2f} MB"
    return f"{num_bytes:,} B"


def format_per_token(num_bytes: int) -> str:
    """Bytes per token, exact with KiB alongside: '327,680 B (320 KiB)'."""
    kib = f"{num_bytes / 1024:,.2f}".rstrip("0").rstrip(".")
    return f"{num_bytes:,} B ({kib} KiB)"


class Formula(NamedTuple):
    """One printed formula: what it computes, in symbols, and with this run's numbers."""

    name: str
    formula: str
    value: str


@dataclass(frozen=True)
class BudgetCapacity:
    """Concurrent sequences a KV budget holds: naive max-length reservation against paged blocks."""

    budget_bytes: int
    max_len: int
    mean_len: int
    block_size: int
    naive_bytes_per_seq: int
    paged_bytes_per_seq: int

    def __post_init__(self):
        for field in ("budget_bytes", "max_len", "mean_len", "block_size", "naive_bytes_per_seq",
                      "paged_bytes_per_seq"):
            require_positive_int(field, getattr(self, field))

    @property
    def num_blocks_per_seq(self) -> int:
        """Blocks of a mean-length sequence: ceil(mean_len / B)."""
        return num_blocks_for(self.mean_len, self.block_size)

    @property
    def paged_tokens_per_seq(self) -> int:
        """The mean length rounded up to whole blocks."""
        return self.num_blocks_per_seq * self.block_size

    @property
    def num_naive_seqs(self) -> int:
        """floor(budget / naive bytes per sequence)."""
        return self.budget_bytes // self.naive_bytes_per_seq

    @property
    def num_paged_seqs(self) -> int:
        """floor(budget / paged bytes per sequence)."""
        return self.budget_bytes // self.paged_bytes_per_seq

    @property
    def gain(self) -> float | None:
        """Paged / naive sequences; None when the budget holds no max-length sequence."""
        return self.num_paged_seqs / self.num_naive_seqs if self.num_naive_seqs else None


def budget_capacity(sizing: KVSizing, budget_bytes: int, max_len: int, mean_len: int,
                    block_size: int = 16) -> BudgetCapacity:
    """Sequences `budget_bytes` of KV memory holds: reserved at `max_len`, or paged at `mean_len`.

    The paged estimate rounds each sequence up to whole blocks of `block_size` tokens.
    """
    require_positive_int("budget_bytes", budget_bytes)
    require_positive_int("max_len", max_len)
    require_positive_int("mean_len", mean_len)
    require_positive_int("block_size", block_size)
    if mean_len > max_len:
        raise InvalidArgumentError(f"mean_len {mean_len} is over max_len {max_len}")
    return BudgetCapacity(budget_bytes=budget_bytes, max_len=max_len, mean_len=mean_len, block_size=block_size,
                          naive_bytes_per_seq=sizing.seq_kv_bytes(max_len),
                          paged_bytes_per_seq=sizing.paged_seq_kv_bytes(mean_len, block_size))


def block_size_sweep(lengths: Sequence[int], max_seq_len: int, bytes_per_token: int,
                     block_sizes: Sequence[int] = SWEEP_BLOCK_SIZES) -> list[MemoryReport]:
    """One `MemoryReport` per block size: smaller pages waste less but need longer block tables."""
    return [memory_report(lengths, size, max_seq_len, bytes_per_token) for size in block_sizes]


# ---------------------------------------------------------------------- formulas
def sizing_formulas(sizing: KVSizing, block_size: int) -> list[Formula]:
    """bytes/token (and per layer when some layers slide) and bytes/block."""
    symbolic, numeric = sizing.bytes_per_token_formula()
    formulas = [Formula("bytes/token", symbolic, f"{numeric} = {sizing.bytes_per_token:,} B")]
    if sizing.num_sliding_layers:
        per_layer = ("(kv_lora_rank + qk_rope_head_dim) * dtype_bytes" if sizing.is_mla
                     else "2 * kv_heads * head_dim * dtype_bytes")
        formulas.append(Formula("bytes/token/layer", per_layer,
                                f"{sizing.bytes_per_token_per_layer:,} B"))
    formulas.append(Formula("bytes/block", "B * bytes/token",
                            f"{block_size} * {sizing.bytes_per_token:,} = "
                            f"{format_bytes(sizing.page_size_bytes(block_size))}"))
    return formulas


def budget_formulas(sizing: KVSizing, capacity: BudgetCapacity) -> list[Formula]:
    """Per-sequence bytes, both capacities and the gain, with this budget's numbers."""
    c = capacity
    if sizing.num_sliding_layers:
        window = sizing.sliding_window_tokens
        window_blocks = sizing.window_blocks(c.block_size)
        naive = Formula("naive per seq", "(full_layers * max_len + sliding_layers * min(max_len, W)) "
                        "* bytes/token/layer",
                        f"({sizing.num_full_layers} * {c.max_len:,} + {sizing.num_sliding_layers} * "
                        f"{min(c.max_len, window):,}) * {sizing.bytes_per_token_per_layer:,} = "
                        f"{format_bytes(c.naive_bytes_per_seq)}")
        paged = Formula("paged per seq", "(full_layers * ceil(mean_len / B) + sliding_layers * "
                        "min(ceil(mean_len / B), ceil((W - 1) / B) + 1)) * B * bytes/token/layer",
                        f"({sizing.num_full_layers} * {c.num_blocks_per_seq} + {sizing.num_sliding_layers} * "
                        f"{min(c.num_blocks_per_seq, window_blocks)}) * {c.block_size} * "
                        f"{sizing.bytes_per_token_per_layer:,} = {format_bytes(c.paged_bytes_per_seq)}")
    else:
        naive = Formula("naive per seq", "max_len * bytes/token",
                        f"{c.max_len:,} * {sizing.bytes_per_token:,} = {format_bytes(c.naive_bytes_per_seq)}")
        paged = Formula("paged per seq", "ceil(mean_len / B) * B * bytes/token",
                        f"{c.num_blocks_per_seq:,} * {c.block_size} * {sizing.bytes_per_token:,} = "
                        f"{format_bytes(c.paged_bytes_per_seq)}")
    gain = f"{c.num_paged_seqs} / {c.num_naive_seqs} = {c.gain:.1f}x" if c.gain is not None \
        else "undefined: the budget holds no max-length sequence"
    return [
        naive,
        paged,
        Formula("naive seqs", "floor(budget / naive per seq)",
                f"floor({format_bytes(c.budget_bytes)} / {format_bytes(c.naive_bytes_per_seq)}) = {c.num_naive_seqs}"),
        Formula("paged seqs", "floor(budget / paged per seq)",
                f"floor({format_bytes(c.budget_bytes)} / {format_bytes(c.paged_bytes_per_seq)}) = {c.num_paged_seqs}"),
        Formula("gain", "paged seqs / naive seqs", f"{gain} (assuming the mean length holds)"),
    ]


def workload_formulas(spec: ModelSpec, report: MemoryReport, num_pool_blocks: int) -> list[Formula]:
    """PageFault's core formulas, with this workload's numbers."""
    r = report
    pool_tokens = num_pool_blocks * r.block_size
    return [
        Formula("bytes/token", "2 * layers * kv_heads * head_dim * dtype_bytes",
                f"2 * {spec.num_layers} * {spec.num_kv_heads} * {spec.head_dim} * {spec.dtype_bytes} = "
                f"{spec.bytes_per_token:,} B"),
        Formula("naive reserved", "num_seqs * max_seq_len * bytes/token",
                f"{r.num_seqs} * {r.max_seq_len:,} * {r.bytes_per_token:,} = {format_bytes(r.naive_reserved_bytes)}"),
        Formula("paged reserved", "sum(ceil(len / B)) * B * bytes/token",
                f"{r.num_blocks:,} * {r.block_size} * {r.bytes_per_token:,} = {format_bytes(r.paged_reserved_bytes)}"),
        Formula("utilization", "sum(len) / reserved tokens",
                f"{r.stored_tokens:,} / {r.naive_reserved_tokens:,} = {r.naive_utilization:.1%} naive, "
                f"{r.stored_tokens:,} / {r.paged_reserved_tokens:,} = {r.paged_utilization:.1%} paged"),
        Formula("internal fragmentation", "sum(ceil(len / B) * B - len)  ~ (B - 1) / 2 tokens per seq",
                f"{r.fragmentation_tokens:,} tokens = {r.fragmentation_per_seq:.2f} per seq "
                f"(expected ~{(r.block_size - 1) / 2:.1f})"),
        Formula("naive capacity", "pool tokens / max_seq_len",
                f"{pool_tokens:,} / {r.max_seq_len:,} = {pool_tokens // r.max_seq_len} sequences"),
    ]
