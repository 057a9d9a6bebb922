"""Kernel tunables and the split-KV heuristic, kept free of Triton so any backend can import them.

Decode is memory bound: its time is the bytes of K/V it reads over the bandwidth it gets.
Getting the bandwidth needs enough programs in flight to cover every SM several times.
One program per (sequence, kv head) is plenty for a big batch, but batch 1 with 8 kv heads
is 8 programs on a 132-SM H200. Split-KV (flash-decoding) cuts each sequence's kv range
into `num_splits` pieces, handled by separate programs whose partial results a small kernel
merges by log-sum-exp:

    programs = num_seqs * num_kv_heads * num_splits  >=  target_waves * num_sms
    every split keeps at least min_split_tokens tokens (each split costs a partial write and
    a merge read of num_heads * head_dim fp32, so a split needs a few hundred tokens to pay)

The count comes from host-side ints only (batch, kv heads, the caller's `max_seq_len`, the
SM count), never from a device read, so a decode step can be captured in a CUDA graph.

Small work (few sequences, or short ones) is where per-program start-up and the merge
launch, not bandwidth, set the time; the split partials merge one of two ways (`DecodeTuning.merge`):

    merge="launch"      the grid above, then a merge kernel (the default)
    merge="in_kernel"   the same grid; the last split program of each (sequence, kv
                        head) to finish merges, counted by an atomic counter

A second schedule, `schedule="tiles"` (`triton_decode_tiles`), reads the block table
ahead of the K/V loop, `heads_per_program` kv heads per program, and a split plan that
rounds down to one wave of `programs_per_sm * num_sms` programs (`tiles_plan`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from pagedkv.env import env_choice
from pagedkv.errors import InvalidArgumentError, require_positive_int


DECODE_SCHEDULES = ("split", "tiles")
DECODE_MERGES = ("launch", "in_kernel")
#: How the tiles schedule finds a tile's block ids: a table load per tile ("inline", the split kernel's way),
#: or from a chunk of the table read ahead of the loop via `tl.gather` ("gather") or a one-hot select ("select").
DECODE_TABLES = ("inline", "gather", "select")
#: Programs per SM the tiles schedule plans for when `programs_per_sm` is None (the split kernel
#: fits 4 per SM at head_dim 128; the H200 sweep is in docs/kernels.md).
TILES_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the paged decode kernel. `None` picks the default for the head dim."""

    block_n: int | None = None  # kv tokens loaded per loop iteration (a power of 2, >= 16)
    num_warps: int = 4
    num_stages: int = 3  # H200, 2026-11-30: 3 stages beat 2 by 3-6% on every decode shape
    no_split_waves: float = 2.0  # a batch that already fills this many waves is not split at all ...
    target_waves: float = 4.0  # ... otherwise split until programs >= target_waves * num_sms ...
    min_split_tokens: int = 256  # ... but keep each split at least this long
    max_splits: int = 128
    dot_min_group: int = 1  # from this group size on, tl.dot (M padded to 16); below it a multiply-sum
    # (the multiply-sum ran at 0.4 TB/s on the H200 against 3.8-4.2 for tl.dot, so MHA uses tl.dot too)
    schedule: str = "split"  # "split" (grid seq x kv head x split) or "tiles"
    merge: str = "launch"  # split partials merged by a second "launch" or "in_kernel" by the last arrival
    programs_per_sm: int | None = None  # tiles: the split plan's programs per SM, None: TILES_PROGRAMS_PER_SM
    heads_per_program: int = 1  # tiles: kv heads one program reads (narrowed to a power-of-2 divisor of Hkv)
    table: str = "gather"  # tiles: how a tile finds its block ids (DECODE_TABLES)
    table_chunk: int = 64  # tiles: block-table entries read ahead per outer step (a power of 2)
    tiles_max_waves: float | None = None  # tiles: a batch of >= this many waves of (seq x kv head) items
    # runs the default split schedule instead (split is at copy speed there); None: tiles always
    # FP8 caches, split schedule: 1-byte tiles of 128 tokens hold bf16's 64-token bytes, and 2 warps
    # beat 4 and 8 by 1.3-1.6x (H200: B=64 x 4096 193 us at 128/2 against 317 at 64/4).
    # They apply while block_n is None: an explicit block_n means the caller tunes the launch (and
    # then num_warps is theirs too). None: the model-dtype settings. The tiles schedule takes
    # fp8_num_warps (also only while block_n is None) but keeps the model-dtype tile (64 tokens,
    # 32 at head_dim 256): FP8 tiles of 128 tokens ran 1.3-1.8x slower there.
    fp8_block_n: int | None = 128
    fp8_num_warps: int | None = 2

    def __post_init__(self):
        if self.block_n is not None and (self.block_n < 16 or self.block_n & (self.block_n - 1)):
            raise InvalidArgumentError(f"block_n must be a power of 2 >= 16, got {self.block_n}")
        for name in ("num_warps", "num_stages", "min_split_tokens", "max_splits", "dot_min_group",
                     "heads_per_program"):
            require_positive_int(name, getattr(self, name))
        if self.fp8_block_n is not None and (self.fp8_block_n < 32 or self.fp8_block_n & (self.fp8_block_n - 1)):
            raise InvalidArgumentError(f"fp8_block_n must be a power of 2 >= 32 or None, got {self.fp8_block_n}")
        if self.fp8_num_warps is not None:
            require_positive_int("fp8_num_warps", self.fp8_num_warps)
        if self.programs_per_sm is not None:
            require_positive_int("programs_per_sm", self.programs_per_sm)
        if not self.target_waves > 0:
            raise InvalidArgumentError(f"target_waves must be > 0, got {self.target_waves}")
        if self.schedule not in DECODE_SCHEDULES:
            raise InvalidArgumentError(f"schedule must be one of {DECODE_SCHEDULES}, got {self.schedule!r}")
        if self.merge not in DECODE_MERGES:
            raise InvalidArgumentError(f"merge must be one of {DECODE_MERGES}, got {self.merge!r}")
        if self.table not in DECODE_TABLES:
            raise InvalidArgumentError(f"table must be one of {DECODE_TABLES}, got {self.table!r}")
        if self.tiles_max_waves is not None and not self.tiles_max_waves > 0:
            raise InvalidArgumentError(f"tiles_max_waves must be > 0 or None, got {self.tiles_max_waves}")
        if isinstance(self.table_chunk, bool) or not isinstance(self.table_chunk, int) or self.table_chunk < 2 \
                or self.table_chunk & (self.table_chunk - 1):
            raise InvalidArgumentError(f"table_chunk must be a power of 2 >= 2, got {self.table_chunk!r}")

    def block_n_for(self, head_dim: int, fp8: bool = False) -> int:
        """Tokens per iteration: 64 keeps a bf16 K tile at 16 KiB for head_dim 128; halve it for 256.

        FP8 tiles (1 byte per value) take `fp8_block_n` tokens at the same head dims, unless
        `block_n` is set."""
        if fp8 and self.block_n is None and self.fp8_block_n is not None:
            return self.fp8_block_n if head_dim <= 128 else self.fp8_block_n // 2
        if self.block_n is not None:
            return self.block_n
        return 64 if head_dim <= 128 else 32

    def num_warps_for(self, fp8: bool = False) -> int:
        """Warps per program: `fp8_num_warps` over FP8 tiles (while `block_n` is None), else `num_warps`."""
        if fp8 and self.block_n is None and self.fp8_num_warps is not None:
            return self.fp8_num_warps
        return self.num_warps

    def runs_tiles(self, num_items: int, sm_count: int) -> bool:
        """Whether a batch of `num_items` (sequence x kv head) items runs the tiles schedule."""
        return self.schedule == "tiles" and (self.tiles_max_waves is None
                                             or num_items < self.tiles_max_waves * sm_count)

    def tiles_programs_per_sm(self) -> int:
        """Programs per SM the tiles schedule's split plan aims at (one wave, rounded down)."""
        return self.programs_per_sm if self.programs_per_sm is not None else TILES_PROGRAMS_PER_SM


def _check_tiles(tuning) -> None:
    """block_m / block_n are powers of 2 >= 16 (or None), num_warps / num_stages positive (or None)."""
    for name in ("block_m", "block_n"):
        value = getattr(tuning, name)
        if value is not None and (value < 16 or value & (value - 1)):
            raise InvalidArgumentError(f"{name} must be a power of 2 >= 16, got {value}")
    for name in ("num_warps", "num_stages"):
        if getattr(tuning, name) is not None:
            require_positive_int(name, getattr(tuning, name))


@dataclass(frozen=True)
class PrefillTuning:
    """Launch parameters of the paged prefill kernel (FlashAttention-2 style tiles)."""

    block_m: int | None = None  # query rows per program
    block_n: int | None = None  # kv tokens per loop iteration
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        _check_tiles(self)

    def tiles_for(self, head_dim: int) -> tuple[int, int, int]:
        """(block_m, block_n, num_warps); smaller kv tiles for head_dim 256 to fit shared memory."""
        # H200, 8 x 2048 causal, head_dim 128: 64 x 64 tiles with 4 warps ran at 311 TFLOP/s,
        # against 260-293 for 128-row tiles.
        block_m = self.block_m or 64
        block_n = self.block_n or (64 if head_dim <= 128 else 32)
        num_warps = self.num_warps or (8 if block_m >= 128 else 4)
        return block_m, block_n, num_warps


@dataclass(frozen=True)
class SplitPrefillTuning:
    """Launch parameters of the split prefill kernel (`triton_prefill_split`: chunk K/V contiguous, prefix paged).

    Fields left None follow the step's shape (`resolve`). H200, Llama-3-8B heads, bf16: with
    at least `wide_programs_per_sm` programs per SM, 128 x 64 tiles, 2 stages and 128
    registers let two 8-warp programs share an SM (8 x 2048 causal: 404 TFLOP/s against
    389 for one program per SM); with fewer, 128 x 128 tiles and 3 stages, one per SM (a
    512-token chunk on a 4,096 prefix: 335-361 against 244-250). A step with under one
    program per SM splits each program's kv range `num_splits` ways (None: 2 when its keys
    are long enough to pay for the merge), merged in the launch by the last split to finish.
    `block_m` must be a multiple of `block_n` (the causal loop's unmasked part ends on a
    query tile's first row). `pack_gqa` (opt-in, not yet measured on a GPU) runs the
    GQA-packed program (`triton_prefill_packed`): one program's `block_m` rows are
    `block_m // group` tokens x a kv head's whole query-head group, so each K/V tile is read
    once per group, not once per query head; a group of 1, or one that does not divide the
    resolved `block_m`, runs the unpacked program (the reason logged once).
    """

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    maxnreg: int | None = None  # register cap per thread (ptxas); 0 means none even where the default sets one
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the unmasked loops (no gain measured)
    num_splits: int | None = None
    wide_programs_per_sm: float = 1.5
    min_split_tokens: int = 1024  # kv tokens per program below which a step is not split
    # Steps whose longest chunk is shorter take the all-paged kernel: its launch is bound (a few us of host
    # time), while this one goes through Triton's own launch (~60 us with its tensor descriptors).
    min_query_tokens: int = 64
    pack_gqa: bool = False  # a program packs a kv head's query heads into its rows (PAGEDKV_PREFILL_PACK_GQA)

    def __post_init__(self):
        _check_tiles(self)
        if self.num_splits is not None:
            require_positive_int("num_splits", self.num_splits)
        require_positive_int("min_query_tokens", self.min_query_tokens)
        if self.maxnreg is not None and (isinstance(self.maxnreg, bool) or not isinstance(self.maxnreg, int)
                                         or self.maxnreg < 0):
            raise InvalidArgumentError(f"maxnreg must be an int >= 0 or None, got {self.maxnreg!r}")
        for name in ("warp_specialize", "pack_gqa"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.block_m is not None and self.block_n is not None and self.block_m % self.block_n:
            raise InvalidArgumentError(f"block_m ({self.block_m}) must be a multiple of block_n ({self.block_n})")

    def with_env_packing(self) -> SplitPrefillTuning:
        """These settings with PAGEDKV_PREFILL_PACK_GQA=on|off applied (read per call; unset keeps `pack_gqa`)."""
        choice = env_choice("PAGEDKV_PREFILL_PACK_GQA", ("on", "off"))
        if choice is None or (choice == "on") == self.pack_gqa:
            return self
        return replace(self, pack_gqa=choice == "on")

    def resolve(self, head_dim: int, num_heads: int, num_seqs: int, max_seqlen_q: int, max_seq_len: int,
                sm_count: int, group: int = 1) -> tuple[int, int, int, int, int | None, int]:
        """(block_m, block_n, num_warps, num_stages, maxnreg, num_splits) for a step of this shape (host ints).

        `group`: query heads packed into one program's rows (the GQA-packed program; 1 unpacked).
        """
        rows = max_seqlen_q * group  # a program's rows are tokens x packed heads
        block_m = self.block_m or (128 if head_dim <= 128 else 64)
        block_m = min(block_m, max(16, 1 << max(0, rows - 1).bit_length()))
        programs = num_heads // group * num_seqs * -(-rows // block_m)
        num_splits = self.num_splits
        if num_splits is None:
            num_splits = 2 if programs <= sm_count and max_seq_len >= 2 * self.min_split_tokens else 1
        wide = programs * num_splits >= self.wide_programs_per_sm * sm_count and head_dim <= 128
        if self.block_n is not None:
            block_n = self.block_n
            block_m = max(block_m, block_n)
        else:  # never taller than the query tile (a short chunk keeps a short tile)
            block_n = min(32 if head_dim > 128 else 64 if wide else 128, block_m)
        num_warps = self.num_warps or (8 if block_m >= 128 else 4)
        num_stages = self.num_stages or (2 if wide or head_dim > 128 else 3)
        maxnreg = self.maxnreg if self.maxnreg is not None else (128 if wide and num_warps == 8 else None)
        return block_m, block_n, num_warps, num_stages, maxnreg or None, num_splits


@dataclass(frozen=True)
class UnifiedTuning:
    """Launch parameters of the unified varlen kernel (decode rows and prefill chunks in one launch).

    A program holds `block_m` rows = `block_m // group` query tokens x the GQA group of one
    kv head, so each K/V tile is loaded once for the whole group, as in decode.
    """

    block_m: int | None = None  # rows per program (a power of 2 >= 16); default 64
    block_n: int | None = None  # kv tokens per loop iteration; default 64 (32 for head_dim 256)
    num_warps: int | None = None  # default 4 (8 for block_m >= 128)
    num_stages: int = 2
    decode_route: bool = True  # a batch of one-token rows (max_seqlen_q 1) runs the decode kernel instead
    decode: DecodeTuning = DecodeTuning()  # ... with these parameters
    # Split-KV (see `splits_for`): a grid of few programs splits each program's kv tiles up to `max_splits`
    # ways, until it holds `target_programs_per_sm` programs per SM; each split keeps at least
    # `min_split_tokens` keys (a query tile's split count is decided on the device, from its own keys).
    # `num_splits` forces the grid's split count (tests; 1 turns splitting off).
    max_splits: int = 16
    target_programs_per_sm: float = 4.0
    min_split_tokens: int = 512
    num_splits: int | None = None

    def __post_init__(self):
        _check_tiles(self)
        if not isinstance(self.decode, DecodeTuning):
            raise InvalidArgumentError(f"decode must be a DecodeTuning, got {type(self.decode).__name__}")
        for name in ("max_splits", "min_split_tokens"):
            require_positive_int(name, getattr(self, name))
        if self.num_splits is not None:
            require_positive_int("num_splits", self.num_splits)
        target = self.target_programs_per_sm
        if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
            raise InvalidArgumentError(f"target_programs_per_sm must be a number > 0, got {target!r}")

    def splits_for(self, grid_programs: int, sm_count: int) -> int:
        """The grid's kv split count, from host ints fixed per captured shape: a grid of (query tile, kv head)
        programs under `target_programs_per_sm * sm_count` is split up to `max_splits` ways (a step's few
        query tiles over long keys: a short prompt on a long cached prefix is otherwise a few dozen programs,
        each walking the whole prefix, on 132 SMs). A grid padded for many sequences (`max_num_seqs` of
        them) is large, so it stays unsplit whatever its real work."""
        if self.num_splits is not None:
            return self.num_splits
        if grid_programs <= 0:
            return 1
        return max(1, min(self.max_splits, int(self.target_programs_per_sm * sm_count) // grid_programs))

    def tiles_for(self, head_dim: int, group: int, max_seqlen_q: int) -> tuple[int, int, int]:
        """(block_m, block_n, num_warps) for a batch whose longest chunk is `max_seqlen_q` tokens.

        The row tile never drops below the group (one token's heads) nor grows past what the
        longest chunk fills, so a batch of short chunks keeps 16-row tiles.
        """
        group_rows = max(16, 1 << (group - 1).bit_length())
        needed = max(16, 1 << (max(1, max_seqlen_q * group) - 1).bit_length())
        block_m = max(group_rows, min(self.block_m or 64, needed))
        block_n = self.block_n or (64 if head_dim <= 128 else 32)
        num_warps = self.num_warps or (8 if block_m >= 128 else 4)
        return block_m, block_n, num_warps


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a few, for the CPU interpreter, so splits still happen)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int,
                      tuning: DecodeTuning = DecodeTuning()) -> int:
    """Split-KV count for a decode batch, from host ints only (see the module docstring)."""
    programs = num_seqs * num_kv_heads
    target = tuning.target_waves * sm_count
    # H200: B=64 x 8 kv heads (3.9 waves) ran at 4.16 TB/s unsplit against 3.80 with 2 splits.
    if programs == 0 or programs >= tuning.no_split_waves * sm_count:
        return 1
    by_length = max(1, max_seq_len // tuning.min_split_tokens)
    by_occupancy = -(-int(target) // programs)
    return max(1, min(by_occupancy, by_length, tuning.max_splits))


def tiles_plan(num_items: int, span_tokens: int, block_n: int, sm_count: int,
               tuning: DecodeTuning = DecodeTuning()) -> tuple[int, int]:
    """(num_splits, split_tokens) of the tiles schedule, from host ints only.

    `num_items` programs' worth of work without splitting (sequences x kv-head groups), each up
    to `span_tokens` long. Split until items x splits reaches `programs_per_sm * sm_count`,
    rounding DOWN (a split count that overshoots puts its last programs in a second wave, which
    then costs a whole program's time), keeping every split >= min_split_tokens and a multiple of
    `block_n`. Split s covers kv positions [s * split_tokens, (s + 1) * split_tokens).
    """
    span = max(1, span_tokens)
    slots = tuning.tiles_programs_per_sm() * sm_count
    splits = slots // num_items if 0 < num_items < slots else 1
    splits = max(1, min(splits, span // tuning.min_split_tokens, tuning.max_splits))
    per_split = -(-span // splits)
    split_tokens = -(-per_split // block_n) * block_n
    return -(-span // split_tokens), split_tokens
