"""`pagedkv bench kernel`: paged decode/prefill kernels against the memory roofline and SDPA.

Decode is memory bound, so the figure of merit is achieved bandwidth: bytes of K/V read
over time, against the device's measured copy bandwidth (a large device-to-device copy,
bytes read + written over time). In the same run it times torch's contiguous SDPA on the
same data (what paging must not lose to), gather + SDPA (the naive paged approach) and,
where it runs, FlexAttention's paged attention. Prefill is compute bound: TFLOP/s of causal
attention, 2 * 2 * H * D * L^2 / 2 per sequence.

Order of work: `--validate` first (Triton vs the float64 reference at full size, bf16),
then the timings, then `--variants` (launch configurations side by side, so one GPU call
can pick the defaults). Timings use `triton.testing.do_bench` (median), which flushes L2
before every call, so even the 67 MB cases read from HBM. It never asserts: misses are
printed as MISSED and recorded in the JSON.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

from pagedkv.cli import ArgumentParser

#: (batch, context length) grid, Llama-3-8B attention: 32 q heads, 8 kv heads, head_dim 128, bf16.
GRID = [(1, 32768), (8, 4096), (64, 4096), (256, 512), (64, 512)]
SMOKE_GRID = [(1, 512), (4, 128)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE_SIZES = (16, 128)
SDPA_REFERENCE_TBPS = {(64, 4096): 4.09, (1, 32768): 2.11, (256, 512): 3.6}  # measured on the H200 (issue 3)


# --------------------------------------------------------------------------- timing helpers
def _time_ms(fn, device) -> float:
    """Median milliseconds of `fn()`: do_bench on CUDA (L2 flushed per call), a short loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
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

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _try_time_graphed(fn, device) -> tuple[float | None, str]:
    """Like `_try_time`, timing CUDA-graph replays on CUDA (plain calls elsewhere)."""
    if device.type != "cuda":
        return _try_time(fn, device)
    try:
        return _time_ms(_graphed(fn), device), ""
    except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
        return None, _describe(error)


def _describe(error: BaseException) -> str:
    """One short line naming an error, for a table cell."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:100]}" if text else type(error).__name__


def _try_time(fn, device) -> tuple[float | None, str]:
    """(ms, "") or (None, reason) when `fn` cannot run."""
    try:
        return _time_ms(fn, device), ""
    except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
        return None, _describe(error)


def copy_bandwidth_tbps(device, num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time, in TB/s."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return 2 * num_bytes / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- data
def make_paged(batch: int, seq_len: int, page: int, shuffled: bool, device, dtype, seed: int = 0):
    """A pool holding `batch` sequences of `seq_len` tokens; tables ordered (0, 1, 2, ...) or shuffled."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-seq_len // page)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, page, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, generator=generator) if shuffled else torch.arange(num_blocks)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    return query, k_cache, v_cache, block_tables, seq_lens


def kv_bytes(batch: int, seq_len: int, element_size: int) -> int:
    """K and V bytes one decode step reads."""
    return 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * element_size


# --------------------------------------------------------------------------- baselines
def contiguous_sdpa(query, k_cache, v_cache, block_tables, seq_len):
    """A closure timing torch SDPA on contiguous [B, Hkv, L, D] copies of the same K/V."""
    import torch.nn.functional as F

    batch = query.shape[0]
    k = k_cache[block_tables.long()].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2).contiguous()
    v = v_cache[block_tables.long()].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2).contiguous()
    q = query.unsqueeze(2)  # [B, H, 1, D]
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def gather_sdpa(query, k_cache, v_cache, block_tables, seq_len):
    """A closure timing the naive paged approach: gather pages into contiguous K/V, then SDPA."""
    import torch.nn.functional as F

    batch, q, table = query.shape[0], query.unsqueeze(2), block_tables.long()

    def run():
        k = k_cache[table].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
        v = v_cache[table].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def flex_paged(query, k_cache, v_cache, block_tables, seq_len):
    """A closure timing FlexAttention's paged decode (torch.nn.attention.experimental._paged_attention).

    Flex wants its physical cache as [1, Hkv, num_pages * page, D] and a block mask whose kv
    block equals the page, converted from logical to physical pages by `PagedAttention`.
    """
    import torch
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, page = query.shape[0], k_cache.shape[1]
    num_pages, blocks_per_seq = k_cache.shape[0], block_tables.shape[1]
    paged = PagedAttention(num_pages, page, batch, device=str(query.device))
    table = block_tables.long()
    paged.page_table[:, :blocks_per_seq] = table
    paged.physical_to_logical[torch.arange(batch, device=query.device)[:, None], table] = torch.arange(
        blocks_per_seq, device=query.device)[None, :]
    paged.capacity[:] = blocks_per_seq * page
    k = k_cache.view(1, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()  # [1, Hkv, pages*page, D]
    v = v_cache.view(1, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    def causal_free(b, h, q_idx, kv_idx):
        return kv_idx < seq_len

    logical = create_block_mask(causal_free, batch, None, 1, blocks_per_seq * page, device=query.device,
                                BLOCK_SIZE=page)
    physical = paged.convert_logical_block_mask(logical)
    compiled = torch.compile(flex_attention, dynamic=False)
    q = query.unsqueeze(2)
    run = functools.partial(compiled, q, k, v, block_mask=physical, enable_gqa=True)
    run()  # compile now, outside the timing
    return run


# --------------------------------------------------------------------------- sections
def validate(device, dtype, backend: str) -> list[dict]:
    """Triton decode and prefill vs the float64 reference on full-size cases; returns one row per case."""
    import torch

    from pagedkv.kernels import (
        paged_decode_attention,
        paged_prefill_attention,
        reference_decode_attention,
        reference_prefill_attention,
    )

    rows, scale = [], HEAD_DIM ** -0.5
    cases = [(8, 4096, 16), (1, 32768, 16), (4, 4096, 128)] if device.type == "cuda" else [(2, 300, 16)]
    for batch, seq_len, page in cases:
        query, k_cache, v_cache, table, _ = make_paged(batch, seq_len, page, True, device, dtype, seed=1)
        lens = torch.tensor([max(1, seq_len - 977 * i) for i in range(batch)], dtype=torch.int32, device=device)
        out = paged_decode_attention(query, k_cache, v_cache, table, lens, scale=scale, max_seq_len=seq_len,
                                     backend=backend)
        expected = reference_decode_attention(query, k_cache, v_cache, table, lens, scale=scale, float64=True)
        rows.append({"kernel": "decode", "case": f"B={batch} L<={seq_len} page={page}",
                     "max_abs_err": float((out.double() - expected).abs().max())})
    q_lens, seq_lens = [2048, 512, 1], [2048, 3000, 1000]
    if device.type != "cuda":
        q_lens, seq_lens = [64, 5], [64, 100]
    query, k_cache, v_cache, table, _ = make_paged(len(q_lens), max(seq_lens), 16, True, device, dtype, seed=2)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    out = paged_prefill_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, max_seqlen_q=max(q_lens),
                                  backend=backend)
    expected = reference_prefill_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, float64=True)
    rows.append({"kernel": "prefill", "case": f"q_lens={q_lens} seq_lens={seq_lens} page=16",
                 "max_abs_err": float((out.double() - expected).abs().max())})
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for row in rows:
        row["ok"] = row["max_abs_err"] <= tolerance
        row["tolerance"] = tolerance
    return rows


def _decode_case(device, dtype, backend: str, batch: int, seq_len: int, page: int, shuffled: bool,
                 with_flex: bool) -> dict:
    """Times (ms) of one B x L x page x order case: paged decode, contiguous SDPA, gather + SDPA, flex."""
    from pagedkv.kernels import paged_decode_attention
    from pagedkv.kernels.tuning import DecodeTuning, choose_num_splits, num_sms

    query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, shuffled, device, dtype)
    paged = functools.partial(paged_decode_attention, query, k_cache, v_cache, table, lens, scale=HEAD_DIM ** -0.5,
                              max_seq_len=seq_len, validate=False, backend=backend)
    # Every contender is timed the same way: CUDA-graph replays (no host launch cost in the numbers).
    ms, error = _try_time_graphed(paged, device)
    eager_ms, _ = _try_time(paged, device)
    sdpa_ms, _ = _try_time_graphed(contiguous_sdpa(query, k_cache, v_cache, table, seq_len), device)
    gather_ms, _ = _try_time_graphed(gather_sdpa(query, k_cache, v_cache, table, seq_len), device)
    flex_ms, flex_note = None, "skipped"
    if with_flex and page == 128 and (batch, seq_len) in ((64, 4096), (1, 32768)):
        try:
            flex_ms, flex_note = _try_time(flex_paged(query, k_cache, v_cache, table, seq_len), device)
        except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
            flex_note = _describe(error)
    return {"ms": ms, "error": error, "eager_ms": eager_ms, "sdpa_ms": sdpa_ms, "gather_ms": gather_ms,
            "flex_ms": flex_ms,
            "flex_note": "" if flex_ms else flex_note,
            "num_splits": choose_num_splits(batch, NUM_KV_HEADS, seq_len, num_sms(device), DecodeTuning())}


def decode_grid(device, dtype, backend: str, grid, copy_tbps: float, with_flex: bool) -> list[dict]:
    """Time paged decode over the B x L grid, both page sizes, ordered and shuffled, plus the baselines."""
    import torch

    rows = []
    for batch, seq_len in grid:
        num_bytes = kv_bytes(batch, seq_len, torch.empty((), dtype=dtype).element_size())

        def tbps(ms, num_bytes=num_bytes):
            return num_bytes / (ms * 1e-3) / 1e12 if ms else None

        for page in PAGE_SIZES:
            ordered_ms = None
            for shuffled in (False, True):
                case = _decode_case(device, dtype, backend, batch, seq_len, page, shuffled, with_flex)
                ms = case["ms"]
                row = {
                    "batch": batch, "seq_len": seq_len, "page": page, "order": "shuffled" if shuffled else "ordered",
                    "num_splits": case["num_splits"], "kv_bytes": num_bytes, "ms": ms, "error": case["error"],
                    "tbps": tbps(ms), "copy_fraction": tbps(ms) / copy_tbps if ms else None,
                    "eager_ms": case["eager_ms"], "eager_tbps": tbps(case["eager_ms"]),
                    "sdpa_tbps": tbps(case["sdpa_ms"]), "vs_sdpa": case["sdpa_ms"] / ms if ms and case["sdpa_ms"] else None,
                    "gather_sdpa_tbps": tbps(case["gather_ms"]),
                    "flex_tbps": tbps(case["flex_ms"]), "flex_note": case["flex_note"],
                }
                if shuffled:
                    row["shuffled_over_ordered"] = ms / ordered_ms if ms and ordered_ms else None
                else:
                    ordered_ms = ms
                row["targets"] = _targets(row, copy_tbps)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _targets(row: dict, copy_tbps: float) -> list[str]:
    """The issue's targets that apply to this row, each 'name: met' or 'name: MISSED'."""
    results = []

    def check(name, passed):
        results.append(f"{name}: {'met' if passed else 'MISSED'}")

    tbps, key = row["tbps"] or 0.0, (row["batch"], row["seq_len"])
    if key == (64, 4096):
        check(">=90% copy BW", tbps >= 0.9 * copy_tbps)
        check(">=0.95x SDPA", (row["vs_sdpa"] or 0) >= 0.95)
    elif key == (1, 32768):
        check(">=3.0 TB/s", tbps >= 3.0)
    elif key == (256, 512):
        check(">=SDPA", (row["vs_sdpa"] or 0) >= 1.0)
    if row["order"] == "shuffled" and row.get("shuffled_over_ordered") is not None:
        check("shuffled within 5%", row["shuffled_over_ordered"] <= 1.05)
    return results


def write_kv_bandwidth(device, dtype, backend: str, num_tokens: int) -> dict:
    """write_kv of `num_tokens` tokens to random slots: (bytes read + written) / time."""
    import torch

    from pagedkv.kernels import write_kv

    page = 16
    num_blocks = 2 * num_tokens // page
    k_cache = torch.empty(num_blocks, page, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * page, device=device)[:num_tokens]
    ms, error = _try_time(lambda: write_kv(key, value, k_cache, v_cache, slots, validate=False, backend=backend),
                          device)
    num_bytes = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
    return {"num_tokens": num_tokens, "ms": ms, "error": error,
            "tbps": num_bytes / (ms * 1e-3) / 1e12 if ms else None}


def prefill_throughput(device, dtype, backend: str, batch: int, seq_len: int, tuning=None) -> dict:
    """Paged causal prefill of `batch` fresh prompts of `seq_len` tokens, against contiguous causal SDPA."""
    import torch
    import torch.nn.functional as F

    from pagedkv.kernels import paged_prefill_attention

    page = 16
    _, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, True, device, dtype, seed=3)
    query = torch.randn(batch * seq_len, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    cu = torch.arange(0, batch * seq_len + 1, seq_len, dtype=torch.int32, device=device)
    flops = batch * 2 * 2 * NUM_HEADS * HEAD_DIM * seq_len**2 / 2
    ms, error = _try_time(functools.partial(
        paged_prefill_attention, query, k_cache, v_cache, table, lens, cu, scale=HEAD_DIM ** -0.5,
        max_seqlen_q=seq_len, validate=False, backend=backend, tuning=tuning), device)
    q = query.view(batch, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    k = k_cache[table.long()].view(batch, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v = v_cache[table.long()].view(batch, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    sdpa_ms, _ = _try_time(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True,
                                             enable_gqa=True), device)
    return {"batch": batch, "seq_len": seq_len, "ms": ms, "error": error,
            "tflops": flops / (ms * 1e-3) / 1e12 if ms else None,
            "sdpa_causal_tflops": flops / (sdpa_ms * 1e-3) / 1e12 if sdpa_ms else None}


def _decode_variants(device, dtype, backend: str, batch: int, seq_len: int, page: int, tunings: dict,
                     deadline: float) -> list[dict]:
    """One row per named DecodeTuning on one shuffled B x L x page case (skipped past `deadline`)."""
    from pagedkv.kernels import paged_decode_attention

    query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, True, device, dtype)
    num_bytes = kv_bytes(batch, seq_len, k_cache.element_size())
    rows = []
    for name, tuning in tunings.items():
        if time.perf_counter() > deadline:
            rows.append({"shape": f"B={batch} L={seq_len} page={page}", "variant": name, "ms": None,
                         "error": "skipped (time budget)", "tbps": None})
            continue
        ms, error = _try_time(functools.partial(
            paged_decode_attention, query, k_cache, v_cache, table, lens, scale=HEAD_DIM ** -0.5,
            max_seq_len=seq_len, validate=False, backend=backend, tuning=tuning), device)
        rows.append({"shape": f"B={batch} L={seq_len} page={page}", "variant": name, "ms": ms, "error": error,
                     "tbps": num_bytes / (ms * 1e-3) / 1e12 if ms else None})
    return rows


def variants(device, dtype, backend: str, smoke: bool, deadline: float) -> dict:
    """Time alternative decode and prefill launch configurations on the shapes that carry targets.

    Variants still waiting at `deadline` (a perf_counter time) are reported as skipped, so the
    whole run stays inside one GPU call.
    """
    import torch

    from pagedkv.kernels import DecodeTuning, PrefillTuning

    decode_variants = {
        "default": DecodeTuning(),
        "block_n=32": DecodeTuning(block_n=32),
        "block_n=128": DecodeTuning(block_n=128),
        "block_n=128 warps=8": DecodeTuning(block_n=128, num_warps=8),
        "warps=8": DecodeTuning(num_warps=8),
        "stages=1": DecodeTuning(num_stages=1),
        "stages=3": DecodeTuning(num_stages=3),
        "stages=4": DecodeTuning(num_stages=4),
        "waves=2": DecodeTuning(target_waves=2),
        "waves=8": DecodeTuning(target_waves=8),
        "min_split=128": DecodeTuning(min_split_tokens=128),
        "min_split=512": DecodeTuning(min_split_tokens=512),
        "no split": DecodeTuning(max_splits=1),
        "multiply-sum, no tl.dot": DecodeTuning(dot_min_group=64),
    }
    shapes = [(64, 4096, 16), (1, 32768, 16), (256, 512, 16), (64, 4096, 128)]
    if smoke:
        decode_variants = dict(list(decode_variants.items())[:3])
        shapes = [(4, 128, 16)]
    decode_rows = []
    for batch, seq_len, page in shapes:
        decode_rows += _decode_variants(device, dtype, backend, batch, seq_len, page, decode_variants, deadline)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    prefill_variants = {
        "default": PrefillTuning(),
        "m64 n64 w4": PrefillTuning(block_m=64, block_n=64, num_warps=4),
        "m128 n128 w8": PrefillTuning(block_m=128, block_n=128, num_warps=8),
        "m128 n64 w8 s3": PrefillTuning(block_m=128, block_n=64, num_warps=8, num_stages=3),
        "m128 n32 w4": PrefillTuning(block_m=128, block_n=32, num_warps=4),
        "m64 n32 w4 s3": PrefillTuning(block_m=64, block_n=32, num_warps=4, num_stages=3),
    }
    if smoke:
        prefill_variants = dict(list(prefill_variants.items())[:2])
    batch, seq_len = (8, 2048) if not smoke else (1, 64)
    prefill_rows = []
    for name, tuning in prefill_variants.items():
        if time.perf_counter() > deadline:
            prefill_rows.append({"variant": name, "tflops": None, "error": "skipped (time budget)"})
            continue
        row = prefill_throughput(device, dtype, backend, batch, seq_len, tuning=tuning)
        prefill_rows.append({"variant": name, **row})
    return {"decode": decode_rows, "prefill": prefill_rows}


# --------------------------------------------------------------------------- report
def _fmt(value, spec: str = ".2f", missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def _decode_table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["B", "L", "page", "order", "splits", "time us", "TB/s", "% copy", "eager TB/s", "SDPA TB/s",
              "paged/SDPA", "gather+SDPA TB/s", "flex TB/s", "targets"]
    body = []
    for row in rows:
        body.append([
            str(row["batch"]), str(row["seq_len"]), str(row["page"]), row["order"], str(row["num_splits"]),
            _fmt(row["ms"] and row["ms"] * 1e3, ".1f", row["error"] or "n/a"), _fmt(row["tbps"]),
            _fmt(row["copy_fraction"] and 100 * row["copy_fraction"], ".0f"), _fmt(row.get("eager_tbps")),
            _fmt(row["sdpa_tbps"]),
            _fmt(row["vs_sdpa"]), _fmt(row["gather_sdpa_tbps"]),
            _fmt(row["flex_tbps"], ".2f", "n/a" + (f" ({row['flex_note']})" if row["flex_note"] != "skipped" else "")),
            "; ".join(row["targets"]),
        ])
    return header, body


def write_markdown(path: Path, result: dict) -> Path:
    """`kernel.md`: provenance, then the same tables the console shows."""
    prov = result["provenance"]
    lines = ["# pagedkv bench kernel", "",
             (f"Device: {prov['device']}; date: {prov['date']}; commit: {prov['commit']}; "
              f"dtype {result['dtype']}; Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128)."), "",
             f"Measured copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s", "",
             "Decode times are medians of CUDA-graph replays (do_bench, L2 flushed between calls) for paged, "
             "SDPA and gather+SDPA alike; 'eager TB/s' is the same paged call launched from Python, whose "
             "host launch cost shows in the small cases. FlexAttention is timed eagerly.", ""]
    if result.get("validation"):
        lines += ["## Validation (Triton vs float64 reference)", "", "| kernel | case | max abs err | ok |",
                  "|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['case']} | {r['max_abs_err']:.2e} | {r['ok']} |" for r in result["validation"]]
        lines.append("")
    header, body = _decode_table_rows(result["decode"])
    lines += ["## Decode", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    w, p = result["write_kv"], result["prefill"]
    lines += ["", f"write_kv, {w['num_tokens']} tokens to random slots: {_fmt(w['tbps'])} TB/s (read + write)",
              (f"prefill, {p['batch']} x {p['seq_len']} causal: {_fmt(p['tflops'], '.1f')} TFLOP/s "
               f"(contiguous causal SDPA: {_fmt(p['sdpa_causal_tflops'], '.1f')} TFLOP/s)"), ""]
    if result.get("variants"):
        lines += ["## Variants", "", "| shape | variant | TB/s |", "|---|---|---|"]
        lines += [f"| {r['shape']} | {r['variant']} | {_fmt(r['tbps'], '.2f', r['error'] or 'n/a')} |"
                  for r in result["variants"]["decode"]]
        lines += ["", "| prefill variant | TFLOP/s |", "|---|---|"]
        lines += [f"| {r['variant']} | {_fmt(r['tflops'], '.1f', r['error'] or 'n/a')} |"
                  for r in result["variants"]["prefill"]]
    path.mkdir(parents=True, exist_ok=True)
    target = path / "kernel.md"
    target.write_text("\n".join(lines) + "\n")
    return target


def main(argv: list[str] | None = None, prog: str = "pagedkv bench kernel") -> int:
    """Validate, time and report the paged kernels; writes `<out>/kernel.json` and `<out>/kernel.md`."""
    parser = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results", help="directory for kernel.json and kernel.md")
    parser.add_argument("--validate", action="store_true", help="check Triton vs the reference first")
    parser.add_argument("--variants", action="store_true", help="also time alternative launch configurations")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes ~30 s)")
    parser.add_argument("--budget-s", type=float, default=220.0,
                        help="variants still waiting after this many seconds of the run are skipped")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; runs on CPU through the torch path (checks the script, not the GPU)")
    args = parser.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from pagedkv.bench.common import provenance, write_json

    console = Console(width=220)  # logs of a remote run are not a terminal: keep rows on one line
    if torch.cuda.is_available():
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, "triton"
        device_name = torch.cuda.get_device_name(device)
    elif args.smoke:
        device, dtype, backend = torch.device("cpu"), torch.float32, "torch"
        device_name = "cpu (smoke: torch path)"
    else:
        console.print("pagedkv bench kernel needs a CUDA GPU (use --smoke to exercise the script on CPU)")
        return 1
    started = time.perf_counter()
    result: dict = {"benchmark": "kernel", "dtype": str(dtype).removeprefix("torch."), "backend": backend}
    result["provenance"] = provenance(device=device_name)

    if args.validate:
        result["validation"] = validate(device, dtype, backend)
        for row in result["validation"]:
            console.print(f"validate {row['kernel']:<8} {row['case']:<40} max abs err {row['max_abs_err']:.2e} "
                          f"(tol {row['tolerance']:.0e}): {'ok' if row['ok'] else 'FAILED'}")

    result["copy_tbps"] = copy_bandwidth_tbps(device, 2 * 2**30 if device.type == "cuda" else 2**26)
    console.print(f"copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s")
    grid = GRID if not args.smoke else SMOKE_GRID
    result["decode"] = decode_grid(device, dtype, backend, grid, result["copy_tbps"],
                                   with_flex=not args.no_flex and device.type == "cuda")
    header, body = _decode_table_rows(result["decode"])
    table = Table(title=f"Paged decode, Llama-3-8B attention, {result['dtype']} on {device_name}")
    for column in header:
        table.add_column(column, justify="right" if column not in ("order", "targets") else "left")
    for cells in body:
        table.add_row(*cells)
    console.print(table)

    result["write_kv"] = write_kv_bandwidth(device, dtype, backend, 16384 if device.type == "cuda" else 256)
    prefill_shape = (8, 2048) if device.type == "cuda" else (1, 64)
    result["prefill"] = prefill_throughput(device, dtype, backend, *prefill_shape)
    w, p = result["write_kv"], result["prefill"]
    console.print(f"write_kv {w['num_tokens']} tokens: {_fmt(w['tbps'])} TB/s (read + write) {w['error']}")
    console.print(f"prefill {p['batch']} x {p['seq_len']} causal: {_fmt(p['tflops'], '.1f')} TFLOP/s; contiguous "
                  f"causal SDPA {_fmt(p['sdpa_causal_tflops'], '.1f')} TFLOP/s {p['error']}")

    if args.variants:
        result["variants"] = variants(device, dtype, backend, args.smoke, deadline=started + args.budget_s)
        table = Table(title="Decode variants (TB/s; best per shape marked *)")
        shapes = list(dict.fromkeys(r["shape"] for r in result["variants"]["decode"]))
        table.add_column("variant")
        for shape in shapes:
            table.add_column(shape, justify="right")
        best = {s: max((r["tbps"] or 0) for r in result["variants"]["decode"] if r["shape"] == s) for s in shapes}
        by_variant: dict[str, dict[str, dict]] = {}
        for r in result["variants"]["decode"]:
            by_variant.setdefault(r["variant"], {})[r["shape"]] = r
        for name, cells in by_variant.items():
            table.add_row(name, *[_fmt(cells[s]["tbps"], ".2f", (cells[s]["error"] or "n/a")[:30])
                                  + ("*" if cells[s]["tbps"] and cells[s]["tbps"] == best[s] else "")
                                  for s in shapes])
        console.print(table)
        table = Table(title="Prefill variants, 8 x 2048 causal")
        table.add_column("variant")
        table.add_column("TFLOP/s", justify="right")
        for r in result["variants"]["prefill"]:
            table.add_row(r["variant"], _fmt(r["tflops"], ".1f", (r["error"] or "n/a")[:40]))
        console.print(table)

    result["elapsed_s"] = time.perf_counter() - started
    console.print(f"wrote {write_json(args.out, 'kernel', result)} and {write_markdown(Path(args.out), result)} "
                  f"in {result['elapsed_s']:.0f} s")
    return 0
