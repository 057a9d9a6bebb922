"""What the sections of `pagedkv bench kernel` share: Llama-3-8B attention shapes, paged test data,
timing (CUDA-graph replays under `do_bench`), checks against the reference, and table cells.

The sections (`bench.kernel_validate`, `bench.kernel_decode` (the grid), `bench.kernel_prefill`,
`bench.kernel_variants`, `bench.kernel_fp8` (FP8 against bf16 caches), `bench.kernel_steps`
(engine-shaped cases), `bench.kernel_flashinfer`) all import from here and never the reverse;
`bench.kernel` runs them in order and `bench.kernel_report` writes what they return.
"""

from __future__ import annotations

import time

#: Llama-3-8B attention: 32 q heads, 8 kv heads, head_dim 128.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
LLAMA3 = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)


def decode_contenders():
    """Decode schedules timed side by side on every grid case: name -> DecodeTuning. The first is the default."""
    from pagedkv.kernels import DecodeTuning

    return {
        "split": DecodeTuning(),
        "split, in-kernel merge": DecodeTuning(merge="in_kernel"),
    }


# --------------------------------------------------------------------------- timing
def _time_ms(fn, device) -> float:
    """Median milliseconds of `fn()`: do_bench on CUDA (L2 flushed per call), a short loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        # 50 ms of replays is thousands of samples for a 50-us kernel; the run must fit one GPU call.
        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[1] * 1e3


def _graphed(fn):
    """`fn` captured in a CUDA graph; returns the replay. Host launch cost (tens of us per Triton
    launch on the H200 host) then stays out of kernels that themselves take tens of us."""
    import torch

    from pagedkv.engine.piecewise_graphs import CAPTURE_ERROR_MODE

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=CAPTURE_ERROR_MODE):
        fn()
    return graph.replay


def try_time_graphed(fn, device) -> tuple[float | None, str]:
    """Like `try_time`, timing CUDA-graph replays on CUDA (plain calls elsewhere)."""
    if device.type != "cuda":
        return try_time(fn, device)
    try:
        return _time_ms(_graphed(fn), device), ""
    except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
        return None, describe(error)


def describe(error: BaseException) -> str:
    """One short line naming an error, for a table cell."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:100]}" if text else type(error).__name__


def try_time(fn, device) -> tuple[float | None, str]:
    """(ms, "") or (None, reason) when `fn` cannot run."""
    try:
        return _time_ms(fn, device), ""
    except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
        return None, describe(error)


def copy_bandwidth_tbps(device, num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time, in TB/s."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return 2 * num_bytes / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- checks
def tolerance_for(dtype) -> float:
    """Max abs error allowed against the float64 reference (bf16 output rounding dominates)."""
    import torch

    return 2e-2 if dtype == torch.bfloat16 else 2e-3


def max_abs_err(out, expected) -> float:
    """Largest |out - expected| (NaN counts as infinitely wrong)."""
    diff = (out.double() - expected.double()).abs()
    return float("inf") if bool(diff.isnan().any()) else float(diff.max()) if diff.numel() else 0.0


def tbps(num_bytes: int, ms: float | None) -> float | None:
    """Bytes over milliseconds, in TB/s."""
    return num_bytes / (ms * 1e-3) / 1e12 if ms else None


# --------------------------------------------------------------------------- data
def make_paged(batch: int, seq_len: int, page: int, shuffled: bool, device, dtype, seed: int = 0,
               heads: tuple[int, int, int] = LLAMA3):
    """A pool holding `batch` sequences of `seq_len` tokens; tables ordered (0, 1, 2, ...) or shuffled.

    `heads` is (q heads, kv heads, head_dim).
    """
    import torch

    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-seq_len // page)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, generator=generator) if shuffled else torch.arange(num_blocks)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    return query, k_cache, v_cache, block_tables, seq_lens


def shuffled_layout(seq_lens, block_size: int, generator, extra_blocks: int = 31, device="cuda"):
    """(num_blocks, block_tables `[B, max_blocks + 3]` int32, slots) on `device`: each sequence's blocks
    drawn in shuffled order from a pool of its blocks plus `extra_blocks`, the table's unused columns
    pointing at blocks nobody owns (so a kernel that reads past a sequence's end reads whatever poisons them).

    The layout the kernel tests and the prefill tuning tool share."""
    import torch

    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks, generator=generator)
    owned, unowned = order[: sum(blocks_per_seq)], order[sum(blocks_per_seq):]
    table = unowned[torch.randint(len(unowned), (len(seq_lens), max(blocks_per_seq) + 3), generator=generator)]
    slots, start = [], 0
    for b, (n, num) in enumerate(zip(seq_lens, blocks_per_seq)):
        table[b, :num] = owned[start : start + num]
        start += num
        positions = torch.arange(n)
        slots.append(table[b, positions // block_size] * block_size + positions % block_size)
    return num_blocks, table.to(torch.int32).to(device), torch.cat(slots).to(device)


def chunk_kv(k_cache, v_cache, block_tables, seq_lens: list[int], q_lens: list[int]):
    """(key, value) `[sum(q_lens), Hkv, D]`, contiguous: each chunk's own K/V rows as the pool holds them.

    What the engine hands the split prefill kernel (the step's QKV rows), rebuilt here from the pool."""
    import torch

    keys, values = [], []
    for row, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        blocks = block_tables[row].long()
        keys.append(k_cache[blocks].flatten(0, 1)[seq_len - q_len:seq_len])
        values.append(v_cache[blocks].flatten(0, 1)[seq_len - q_len:seq_len])
    return torch.cat(keys).contiguous(), torch.cat(values).contiguous()


def kv_bytes(batch: int, seq_len: int, element_size: int, heads: tuple[int, int, int] = LLAMA3) -> int:
    """K and V bytes one decode step reads."""
    return 2 * batch * seq_len * heads[1] * heads[2] * element_size


# --------------------------------------------------------------------------- baselines and tunings
def contiguous_sdpa(query, k_cache, v_cache, block_tables, seq_len):
    """A closure timing torch SDPA on contiguous [B, Hkv, L, D] copies of the same K/V."""
    import torch.nn.functional as F

    batch, (num_kv_heads, head_dim) = query.shape[0], k_cache.shape[2:]
    table = block_tables.long()
    k = k_cache[table].view(batch, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2).contiguous()
    v = v_cache[table].view(batch, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2).contiguous()
    q = query.unsqueeze(2)  # [B, H, 1, D]
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def sdpa_flash_causal(q, k, v):
    """A closure of causal SDPA on the flash backend, and how it ran.

    q `[B, H, L, D]`, k/v `[B, Hkv, L, D]`. Flash with `enable_gqa` where this torch has it;
    else flash on K/V expanded to H heads (the copy made here, outside the timing); else
    whatever backend SDPA picks.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    expanded = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)) if group > 1 else (k, v)
    candidates = [
        ("flash", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), True),
        ("flash, K/V expanded", lambda: F.scaled_dot_product_attention(q, *expanded, is_causal=True), True),
        ("default backend", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), False),
    ]
    for name, call, flash_only in candidates:
        def run(call=call, flash_only=flash_only):
            if not flash_only:
                return call()
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return call()
        try:
            run()
            return run, name
        except RuntimeError:
            continue
    return candidates[-1][1], "default backend"


def unified_variant_tunings() -> dict:
    """Unified-kernel tile configurations: rows = tokens x GQA group (block_m 64 = 16 tokens x 4 heads)."""
    from pagedkv.kernels import UnifiedTuning

    return {
        "unified m64": UnifiedTuning(),
        "unified m16": UnifiedTuning(block_m=16),
        "unified m32": UnifiedTuning(block_m=32),
        "unified m64 s3": UnifiedTuning(num_stages=3),
        "unified m128 w8": UnifiedTuning(block_m=128, num_warps=8),
        "unified m128 w8 s3": UnifiedTuning(block_m=128, num_warps=8, num_stages=3),
        "unified m128 n32 w4": UnifiedTuning(block_m=128, block_n=32, num_warps=4),
    }


# --------------------------------------------------------------------------- report
def fmt(value, spec: str = ".2f", missing: str = "n/a") -> str:
    """`value` formatted with `spec` for a table cell, or `missing` when it is None."""
    return missing if value is None else format(value, spec)
