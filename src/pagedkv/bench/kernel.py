"""`pagedkv bench kernel`: paged decode/prefill kernels against the memory roofline and SDPA.

Decode is memory bound, so the figure of merit is achieved bandwidth: bytes of K/V read
over time, against the device's measured copy bandwidth (a large device-to-device copy,
bytes read + written over time). In the same run it times torch's contiguous SDPA on the
same data (what paging must not lose to), gather + SDPA (the naive paged approach) and,
where it runs, FlexAttention's paged attention. Prefill is compute bound: TFLOP/s of causal
attention, 2 * 2 * H * D * L^2 / 2 per sequence.

Every pagedkv contender is validated before it is timed: the named kernels and decode
schedules against the float64 reference first (`--validate`, always on in a GPU run),
then each grid case's schedules against the default schedule's output, and each step case
(`kernel_steps`: engine shapes, chunked prefill, a mixed step) against the reference on its
own data. A contender that fails is reported and not timed.

Order of work: validation, the FP8 decode cases when `--kv-dtype` names an FP8 format
(`kernel_fp8`: FP8 against bf16 caches in the same run; `--fp8-only` stops there), the decode
grid (old and new decode schedules side by side), write_kv, prefill, the step cases, FlashInfer
beside pagedkv when `flashinfer` imports (`kernel_flashinfer`: decode, prefill and FP8 decode on
the same pool; without it one line says so), then `--variants` (launch configurations side by
side, skipped past `--budget-s`). Timings are
medians of CUDA-graph replays under `triton.testing.do_bench`, which flushes L2 before every
call. It never asserts: each target is printed as met or MISSED with its measured figure, and
recorded in the JSON. Shared shapes, data and timing live in `bench.kernel_common`.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    chunk_kv,
    contiguous_sdpa,
    copy_bandwidth_tbps,
    decode_contenders,
    describe,
    fmt,
    kv_bytes,
    make_paged,
    max_abs_err,
    sdpa_flash_causal,
    tbps,
    tolerance_for,
    try_time,
    try_time_graphed,
    unified_variant_tunings,
)
from pagedkv.cli import ArgumentParser
from pagedkv.results import add_out_argument

#: (batch, context length) grid, Llama-3-8B attention: 32 q heads, 8 kv heads, head_dim 128, bf16.
GRID = [(1, 32768), (8, 4096), (64, 4096), (256, 512), (64, 512)]
SMOKE_GRID = [(1, 256), (4, 64)]
PAGE_SIZES = (16, 128)
SDPA_REFERENCE_TBPS = {(64, 4096): 4.09, (1, 32768): 2.11, (256, 512): 3.6}  # measured on the H200
#: Small-work decode cases that carry the >= 80% of copy target.
SMALL_WORK = ((1, 32768), (8, 4096), (64, 512))


# --------------------------------------------------------------------------- baselines
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


# --------------------------------------------------------------------------- validation
def validate(device, dtype, backend: str, decode_tunings: dict, prefill_tunings: dict,
             unified_tunings: dict) -> list[dict]:
    """Every named contender vs the float64 reference on full-size cases; one row per (contender, case)."""
    import torch

    from pagedkv.kernels import (
        KernelWorkspace,
        paged_attention,
        paged_decode_attention,
        paged_prefill_attention,
        reference_decode_attention,
        reference_prefill_attention,
    )

    rows, scale, tolerance = [], HEAD_DIM ** -0.5, tolerance_for(dtype)
    workspace = KernelWorkspace(8 * NUM_KV_HEADS, device)

    def record(kernel, contender, case, call, expected):
        try:
            err, error = max_abs_err(call(), expected), ""
        except Exception as failure:  # noqa: BLE001 - reported as a failed contender
            err, error = float("inf"), describe(failure)
        rows.append({"kernel": kernel, "contender": contender, "case": case, "max_abs_err": err,
                     "ok": err <= tolerance, "tolerance": tolerance, "error": error})

    cases = [(8, 4096, 16), (1, 32768, 16), (4, 4096, 128)] if device.type == "cuda" else [(2, 300, 16)]
    for index, (batch, seq_len, page) in enumerate(cases):
        query, k_cache, v_cache, table, _ = make_paged(batch, seq_len, page, True, device, dtype, seed=1)
        lens = torch.tensor([max(1, seq_len - 977 * i) for i in range(batch)], dtype=torch.int32, device=device)
        expected = reference_decode_attention(query, k_cache, v_cache, table, lens, scale=scale, float64=True)
        # The first case checks every tuning; the others the schedules the grid times.
        tunings = {**decode_contenders(), **decode_tunings} if index == 0 else decode_contenders()
        for name, tuning in tunings.items():
            record("decode", name, f"B={batch} L<={seq_len} page={page}", functools.partial(
                paged_decode_attention, query, k_cache, v_cache, table, lens, scale=scale, max_seq_len=seq_len,
                backend=backend, tuning=tuning, workspace=workspace), expected)
    q_lens, seq_lens = [2048, 512, 1], [2048, 3000, 1000]
    if device.type != "cuda":
        q_lens, seq_lens = [64, 5, 1], [64, 100, 30]
    query, k_cache, v_cache, table, _ = make_paged(len(q_lens), max(seq_lens), 16, True, device, dtype, seed=2)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    expected = reference_prefill_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, float64=True)
    case = f"q_lens={q_lens} seq_lens={seq_lens} page=16"
    for kernel, call, tunings in (("prefill", paged_prefill_attention, prefill_tunings),
                                  ("unified", paged_attention, unified_tunings)):
        for name, tuning in tunings.items():
            record(kernel, name, case, functools.partial(call, query, k_cache, v_cache, table, lens, cu, scale=scale,
                                                         max_seqlen_q=max(q_lens), backend=backend, tuning=tuning),
                   expected)
    key, value = chunk_kv(k_cache, v_cache, table, seq_lens, q_lens)  # the engine's call: the split kernel
    record("prefill", "split", case, functools.partial(paged_prefill_attention, query, k_cache, v_cache, table, lens,
                                                       cu, scale=scale, max_seqlen_q=max(q_lens), backend=backend,
                                                       key=key, value=value), expected)
    workspace.check_integrity()
    return rows


def failed_contenders(rows: list[dict]) -> set[tuple[str, str]]:
    """(kernel, contender) pairs that failed any validation case: the timing sections skip them."""
    return {(row["kernel"], row["contender"]) for row in rows if not row["ok"]}


# --------------------------------------------------------------------------- decode grid
def _decode_case(device, dtype, backend: str, batch: int, seq_len: int, page: int, shuffled: bool,
                 with_flex: bool, workspace, invalid: set) -> dict:
    """Times (ms) of one B x L x page x order case: every decode schedule, contiguous SDPA, gather + SDPA, flex.

    Each schedule but the default is first checked against the default's output on this data.
    """
    from pagedkv.kernels import DecodeTuning, choose_num_splits, paged_decode_attention
    from pagedkv.kernels.tuning import num_sms

    query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, shuffled, device, dtype)
    schedules = {}
    default_out = None
    for name, tuning in decode_contenders().items():
        if ("decode", name) in invalid:
            schedules[name] = {"ms": None, "error": "failed validation"}
            continue
        paged = functools.partial(paged_decode_attention, query, k_cache, v_cache, table, lens,
                                  scale=HEAD_DIM ** -0.5, max_seq_len=seq_len, validate=False, backend=backend,
                                  tuning=tuning, workspace=workspace)
        try:
            out = paged().clone()
        except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
            schedules[name] = {"ms": None, "error": describe(error)}
            continue
        if default_out is None:
            default_out = out
        elif max_abs_err(out, default_out) > tolerance_for(dtype):
            schedules[name] = {"ms": None, "error": f"differs from split by {max_abs_err(out, default_out):.1e}"}
            continue
        # Every contender is timed the same way: CUDA-graph replays (no host launch cost in the numbers).
        ms, error = try_time_graphed(paged, device)
        schedules[name] = {"ms": ms, "error": error}
        if name == "split":
            schedules[name]["eager_ms"], _ = try_time(paged, device)
    sdpa_ms, _ = try_time_graphed(contiguous_sdpa(query, k_cache, v_cache, table, seq_len), device)
    gather_ms, _ = try_time_graphed(gather_sdpa(query, k_cache, v_cache, table, seq_len), device)
    flex_ms, flex_note = None, "skipped"
    if with_flex and page == 128 and (batch, seq_len) in ((64, 4096), (1, 32768)):
        try:
            flex_ms, flex_note = try_time(flex_paged(query, k_cache, v_cache, table, seq_len), device)
        except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
            flex_note = describe(error)
    return {"schedules": schedules, "sdpa_ms": sdpa_ms, "gather_ms": gather_ms, "flex_ms": flex_ms,
            "flex_note": "" if flex_ms else flex_note,
            "num_splits": choose_num_splits(batch, NUM_KV_HEADS, seq_len, num_sms(device), DecodeTuning())}


def decode_grid(device, dtype, backend: str, grid, copy_tbps: float, with_flex: bool, invalid: set,
                progress) -> list[dict]:
    """Time paged decode over the B x L grid, both page sizes, ordered and shuffled, plus the baselines."""
    import torch

    from pagedkv.kernels import KernelWorkspace

    workspace = KernelWorkspace(max(b for b, _ in grid) * NUM_KV_HEADS, device)
    rows = []
    for batch, seq_len in grid:
        num_bytes = kv_bytes(batch, seq_len, torch.empty((), dtype=dtype).element_size())
        for page in PAGE_SIZES:
            ordered_ms = None
            for shuffled in (False, True):
                case = _decode_case(device, dtype, backend, batch, seq_len, page, shuffled, with_flex, workspace,
                                    invalid)
                default = case["schedules"]["split"]
                ms = default["ms"]
                schedule_tbps = {name: tbps(num_bytes, s["ms"]) for name, s in case["schedules"].items()}
                best = max(schedule_tbps, key=lambda name: schedule_tbps[name] or 0.0)
                row = {
                    "batch": batch, "seq_len": seq_len, "page": page, "order": "shuffled" if shuffled else "ordered",
                    "num_splits": case["num_splits"], "kv_bytes": num_bytes, "ms": ms, "error": default["error"],
                    "tbps": tbps(num_bytes, ms), "copy_fraction": tbps(num_bytes, ms) / copy_tbps if ms else None,
                    "eager_ms": default.get("eager_ms"), "eager_tbps": tbps(num_bytes, default.get("eager_ms")),
                    "sdpa_tbps": tbps(num_bytes, case["sdpa_ms"]),
                    "vs_sdpa": case["sdpa_ms"] / ms if ms and case["sdpa_ms"] else None,
                    "gather_sdpa_tbps": tbps(num_bytes, case["gather_ms"]),
                    "flex_tbps": tbps(num_bytes, case["flex_ms"]), "flex_note": case["flex_note"],
                    "schedules": {name: {"tbps": schedule_tbps[name], "error": s["error"]}
                                  for name, s in case["schedules"].items()},
                    "best_schedule": best, "best_tbps": schedule_tbps[best],
                    "best_vs_sdpa": (case["sdpa_ms"] * schedule_tbps[best] * 1e-3 * 1e12 / num_bytes
                                     if case["sdpa_ms"] and schedule_tbps[best] else None),
                }
                if shuffled:
                    row["shuffled_over_ordered"] = ms / ordered_ms if ms and ordered_ms else None
                else:
                    ordered_ms = ms
                row["targets"] = _targets(row, copy_tbps)
                rows.append(row)
                progress(f"decode B={batch} L={seq_len} page={page} {row['order']}: split {fmt(row['tbps'])} TB/s, "
                         f"best {best} {fmt(row['best_tbps'])} TB/s, SDPA {fmt(row['sdpa_tbps'])}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _targets(row: dict, copy_tbps: float) -> list[str]:
    """The issues' targets that apply to this row, each 'name: met (figure)' or 'name: MISSED (figure)'."""
    results = []

    def check(name, passed, figure):
        results.append(f"{name}: {'met' if passed else 'MISSED'} ({figure})")

    key = (row["batch"], row["seq_len"])
    best = row["best_tbps"] or 0.0
    if key == (64, 4096):
        check(">=90% copy BW", (row["tbps"] or 0) >= 0.9 * copy_tbps, f"{fmt(row['tbps'])} TB/s")
        check(">=0.95x SDPA", (row["vs_sdpa"] or 0) >= 0.95, f"{fmt(row['vs_sdpa'])}x")
    elif key in SMALL_WORK:
        check(">=80% copy BW", best >= 0.8 * copy_tbps, f"{best:.2f} TB/s = {100 * best / copy_tbps:.0f}%, "
                                                         f"{row['best_schedule']}")
    elif key == (256, 512):
        check(">=1.0x SDPA", (row["best_vs_sdpa"] or 0) >= 1.0, f"{fmt(row['best_vs_sdpa'])}x, {row['best_schedule']}")
    if row["order"] == "shuffled" and row.get("shuffled_over_ordered") is not None:
        check("shuffled within 5%", row["shuffled_over_ordered"] <= 1.05, f"{row['shuffled_over_ordered']:.3f}")
    return results


# --------------------------------------------------------------------------- write_kv, prefill
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
    ms, error = try_time(lambda: write_kv(key, value, k_cache, v_cache, slots, validate=False, backend=backend),
                         device)
    num_bytes = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
    return {"num_tokens": num_tokens, "ms": ms, "error": error, "tbps": tbps(num_bytes, ms)}


def prefill_throughput(device, dtype, backend: str, batch: int, seq_len: int, tuning=None, kernel: str = "prefill",
                       with_sdpa: bool = True) -> dict:
    """Paged causal prefill of `batch` fresh prompts of `seq_len` tokens, against contiguous causal SDPA (flash).

    `kernel` is "prefill" (`paged_prefill_attention`, the all-paged kernel), "split" (the same call given the
    prompts' own K/V, as the engine makes it: the split kernel) or "unified" (`paged_attention`).
    """
    import torch

    from pagedkv.kernels import paged_attention, paged_prefill_attention

    page = 16
    _, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, True, device, dtype, seed=3)
    query = torch.randn(batch * seq_len, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    cu = torch.arange(0, batch * seq_len + 1, seq_len, dtype=torch.int32, device=device)
    flops = batch * 2 * 2 * NUM_HEADS * HEAD_DIM * seq_len**2 / 2
    call = paged_attention if kernel == "unified" else paged_prefill_attention
    extra = {}
    if kernel == "split":
        extra = dict(zip(("key", "value"), chunk_kv(k_cache, v_cache, table, [seq_len] * batch, [seq_len] * batch)))
    ms, error = try_time(functools.partial(
        call, query, k_cache, v_cache, table, lens, cu, scale=HEAD_DIM ** -0.5,
        max_seqlen_q=seq_len, validate=False, backend=backend, tuning=tuning, **extra), device)
    row = {"batch": batch, "seq_len": seq_len, "kernel": kernel, "ms": ms, "error": error,
           "tflops": flops / (ms * 1e-3) / 1e12 if ms else None}
    if with_sdpa:
        q = query.view(batch, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        k = k_cache[table.long()].view(batch, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        v = v_cache[table.long()].view(batch, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        sdpa, sdpa_backend = sdpa_flash_causal(q, k, v)
        sdpa_ms, _ = try_time(sdpa, device)
        row.update(sdpa_causal_tflops=flops / (sdpa_ms * 1e-3) / 1e12 if sdpa_ms else None, sdpa_backend=sdpa_backend)
        row["vs_sdpa"] = sdpa_ms / ms if ms and sdpa_ms else None
    return row


# --------------------------------------------------------------------------- variants
def decode_variant_tunings() -> dict:
    """Decode launch configurations `--variants` times side by side: the default, then the small-work schedules."""
    from pagedkv.kernels import DecodeTuning

    # Other block_n / warps / stages variants are left out: measured slower (block_n 32, 128) or
    # compiled to the same kernel (stages 4: see docs/kernels.md). Small-work schedules first: the
    # deadline cuts the tail of this list's last shapes.
    return {
        "default": DecodeTuning(),
        "in-kernel merge": DecodeTuning(merge="in_kernel"),
        "in-kernel merge, waves=2": DecodeTuning(merge="in_kernel", target_waves=2),
        "in-kernel merge, min_split=512": DecodeTuning(merge="in_kernel", min_split_tokens=512),
        "min_split=512": DecodeTuning(min_split_tokens=512),
    }


def prefill_variant_tunings() -> dict:
    """Prefill tile configurations `--variants` times on 8 x 2048 causal."""
    from pagedkv.kernels import PrefillTuning

    return {
        "default": PrefillTuning(),
        "m64 n64 w4 s3": PrefillTuning(block_m=64, block_n=64, num_warps=4, num_stages=3),
        "m128 n64 w8": PrefillTuning(block_m=128, block_n=64, num_warps=8),
        "m128 n64 w8 s3": PrefillTuning(block_m=128, block_n=64, num_warps=8, num_stages=3),
        "m128 n128 w8": PrefillTuning(block_m=128, block_n=128, num_warps=8),
        "m128 n32 w4": PrefillTuning(block_m=128, block_n=32, num_warps=4),
        "m64 n32 w4 s3": PrefillTuning(block_m=64, block_n=32, num_warps=4, num_stages=3),
    }


def _decode_variants(device, dtype, backend: str, batch: int, seq_len: int, page: int, tunings: dict,
                     deadline: float, invalid: set) -> list[dict]:
    """One row per named DecodeTuning on one shuffled B x L x page case (skipped past `deadline`)."""
    from pagedkv.kernels import KernelWorkspace, paged_decode_attention

    query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, True, device, dtype)
    num_bytes = kv_bytes(batch, seq_len, k_cache.element_size())
    workspace = KernelWorkspace(batch * NUM_KV_HEADS, device)
    rows = []
    for name, tuning in tunings.items():
        shape = f"B={batch} L={seq_len} page={page}"
        if ("decode", name) in invalid or time.perf_counter() > deadline:
            reason = "failed validation" if ("decode", name) in invalid else "skipped (time budget)"
            rows.append({"shape": shape, "variant": name, "ms": None, "error": reason, "tbps": None})
            continue
        ms, error = try_time_graphed(functools.partial(
            paged_decode_attention, query, k_cache, v_cache, table, lens, scale=HEAD_DIM ** -0.5,
            max_seq_len=seq_len, validate=False, backend=backend, tuning=tuning, workspace=workspace), device)
        rows.append({"shape": shape, "variant": name, "ms": ms, "error": error, "tbps": tbps(num_bytes, ms)})
    return rows


def variants(device, dtype, backend: str, smoke: bool, deadline: float, invalid: set, progress) -> dict:
    """Time alternative decode, prefill and unified launch configurations on the shapes that carry targets.

    Variants still waiting at `deadline` (a perf_counter time) are reported as skipped, so the
    whole run stays inside one GPU call. Decode variants are CUDA-graph replays.
    """
    import torch

    decode_tunings = decode_variant_tunings()
    shapes = [(1, 32768, 16), (8, 4096, 16), (64, 512, 16), (256, 512, 16), (64, 4096, 16)]
    if smoke:
        decode_tunings = {name: decode_tunings[name] for name in ("default", "in-kernel merge", "min_split=512")}
        shapes = [(4, 128, 16)]
    decode_rows = []
    for batch, seq_len, page in shapes:
        decode_rows += _decode_variants(device, dtype, backend, batch, seq_len, page, decode_tunings, deadline,
                                        invalid)
        progress(f"decode variants B={batch} L={seq_len} page={page}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    batch, seq_len = (8, 2048) if not smoke else (1, 64)
    prefill_rows = []
    for kernel, tunings in (("prefill", prefill_variant_tunings()), ("unified", unified_variant_tunings())):
        if smoke:
            tunings = dict(list(tunings.items())[:2])
        for name, tuning in tunings.items():
            if (kernel, name) in invalid or time.perf_counter() > deadline:
                reason = "failed validation" if (kernel, name) in invalid else "skipped (time budget)"
                prefill_rows.append({"variant": name, "kernel": kernel, "tflops": None, "error": reason})
                continue
            row = prefill_throughput(device, dtype, backend, batch, seq_len, tuning=tuning, kernel=kernel,
                                     with_sdpa=False)
            prefill_rows.append({"variant": name, **row})
        progress(f"{kernel} variants {batch} x {seq_len}")
    return {"decode": decode_rows, "prefill": prefill_rows}


# --------------------------------------------------------------------------- report
def _decode_table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    names = list(rows[0].get("schedules", {})) if rows else []
    header = ["B", "L", "page", "order", "splits", "time us", "TB/s", "% copy", "eager TB/s",
              *[f"{name} TB/s" for name in names[1:]], "SDPA TB/s", "paged/SDPA", "best/SDPA", "gather+SDPA TB/s",
              "flex TB/s", "targets"]
    body = []
    for row in rows:
        schedules = row.get("schedules", {})
        body.append([
            str(row["batch"]), str(row["seq_len"]), str(row["page"]), row["order"], str(row["num_splits"]),
            fmt(row["ms"] and row["ms"] * 1e3, ".1f", row["error"] or "n/a"), fmt(row["tbps"]),
            fmt(row["copy_fraction"] and 100 * row["copy_fraction"], ".0f"), fmt(row.get("eager_tbps")),
            *[fmt(schedules[name]["tbps"], ".2f", (schedules[name]["error"] or "n/a")[:24]) for name in names[1:]],
            fmt(row["sdpa_tbps"]), fmt(row["vs_sdpa"]), fmt(row.get("best_vs_sdpa")),
            fmt(row["gather_sdpa_tbps"]),
            fmt(row["flex_tbps"], ".2f", "n/a" + (f" ({row['flex_note']})" if row["flex_note"] != "skipped" else "")),
            "; ".join(row["targets"]),
        ])
    return header, body


def verdict(met: bool | None) -> str:
    """'met', 'MISSED', or 'report' for a figure the issue asks to report without a threshold."""
    return "report" if met is None else "met" if met else "MISSED"


def _markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(c) + " |"
                                                                           for c in body]


def target_summary(result: dict) -> list[dict]:
    """Every target of issues 3 and 12 with its measured figure: {target, measured, met (None: report only)}."""
    summary = []
    for row in result["decode"]:
        if row["order"] != "shuffled" or row["page"] != 16:
            continue
        for text in row["targets"]:
            name, _, rest = text.partition(": ")
            summary.append({"target": f"decode B={row['batch']} x {row['seq_len']}: {name}",
                            "met": rest.startswith("met"), "measured": rest.partition(" ")[2].strip("()")})
    prefill = result["prefill"]
    best = max((r for r in result.get("prefill_contenders", [prefill]) if r.get("tflops")),
               key=lambda r: r["tflops"], default=prefill)
    sdpa = prefill.get("sdpa_causal_tflops")
    ratio = best["tflops"] / sdpa if best.get("tflops") and sdpa else None
    summary.append({"target": f"prefill {prefill['batch']} x {prefill['seq_len']} causal: >=0.85x SDPA "
                              f"({prefill.get('sdpa_backend', '')})",
                    "met": bool(ratio and ratio >= 0.85),
                    "measured": f"{fmt(ratio)}x ({fmt(best.get('tflops'), '.0f')} vs {fmt(sdpa, '.0f')} TFLOP/s, "
                                f"{best.get('label', best.get('kernel', 'prefill'))})"})
    summary += result.get("step_targets", [])
    summary += result.get("fp8_targets", [])
    return summary


def write_markdown(path: Path, result: dict) -> Path:
    """`kernel.md`: provenance, the targets, then the same tables the console shows."""
    prov = result["provenance"]
    lines = ["# pagedkv bench kernel", "",
             (f"Device: {prov['device']}; date: {prov['date']}; commit: {prov['commit']}; "
              f"dtype {result['dtype']}; Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128) "
              f"unless a row names another model."), "",
             f"Measured copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s", "",
             "Times are medians of CUDA-graph replays (do_bench, L2 flushed between calls) for every pagedkv "
             "contender and SDPA / gather+SDPA alike; 'eager TB/s' is the default decode launched from Python, "
             "whose host launch cost shows in the small cases. FlexAttention is timed eagerly.", ""]
    lines += ["## Targets", ""] + _markdown_table(
        ["target", "measured", "met"], [[t["target"], t["measured"], verdict(t["met"])]
                                        for t in result["target_summary"]]) + [""]
    if result.get("validation"):
        lines += ["## Validation (Triton vs float64 reference)", ""] + _markdown_table(
            ["kernel", "contender", "case", "max abs err", "ok"],
            [[r["kernel"], r.get("contender", "default"), r["case"], f"{r['max_abs_err']:.2e}", str(r["ok"])]
             for r in result["validation"]]) + [""]
    if result.get("fp8_decode"):
        from pagedkv.bench.kernel_fp8 import table_rows

        lines += ["## FP8 decode (against the model-dtype cache, same data, same run)", ""] + _markdown_table(
            *table_rows(result["fp8_decode"])) + [""]
    header, body = _decode_table_rows(result["decode"])
    lines += ["## Decode", ""] + _markdown_table(header, body)
    w, p = result["write_kv"], result["prefill"]
    lines += ["", f"write_kv, {w['num_tokens']} tokens to random slots: {fmt(w['tbps'])} TB/s (read + write)",
              (f"prefill, {p['batch']} x {p['seq_len']} causal: {fmt(p['tflops'], '.1f')} TFLOP/s "
               f"(contiguous causal SDPA, {p.get('sdpa_backend', '')}: {fmt(p['sdpa_causal_tflops'], '.1f')} "
               f"TFLOP/s)"), ""]
    if result.get("flashinfer"):
        from pagedkv.bench.kernel_flashinfer import markdown

        lines += markdown(result["flashinfer"])
    for title, key in (("Engine shapes", "engine_shapes"), ("Chunked prefill", "chunked_prefill"),
                       ("Mixed step", "mixed_step")):
        section = result.get("steps", {}).get(key)
        if section:
            lines += [f"## {title}", "", section["note"], ""] + _markdown_table(section["header"], section["body"])
            lines.append("")
    if result.get("variants"):
        lines += ["## Variants", ""] + _markdown_table(
            ["shape", "variant", "TB/s"], [[r["shape"], r["variant"], fmt(r["tbps"], ".2f", r["error"] or "n/a")]
                                           for r in result["variants"]["decode"]])
        lines += [""] + _markdown_table(
            ["prefill variant", "kernel", "TFLOP/s"],
            [[r["variant"], r.get("kernel", "prefill"), fmt(r["tflops"], ".1f", r["error"] or "n/a")]
             for r in result["variants"]["prefill"]])
    path.mkdir(parents=True, exist_ok=True)
    target = path / "kernel.md"
    target.write_text("\n".join(lines) + "\n")
    return target


def _print_table(console, title: str, header: list[str], body: list[list[str]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column in ("order", "targets", "target", "contender",
                                                              "variant", "model") else "right")
    for cells in body:
        table.add_row(*cells)
    console.print(table)


def main(argv: list[str] | None = None, prog: str = "pagedkv bench kernel") -> int:
    """Validate, time and report the paged kernels; writes `<out>/kernel.json` and `<out>/kernel.md`."""
    parser = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_out_argument(parser, "kernel.json and kernel.md")
    parser.add_argument("--validate", action="store_true",
                        help="check every contender vs the reference first (always on for a GPU run)")
    parser.add_argument("--variants", action="store_true", help="also time alternative launch configurations")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes ~30 s)")
    parser.add_argument("--no-flashinfer", action="store_true",
                        help="skip the FlashInfer anchor section (run when flashinfer imports; never required)")
    parser.add_argument("--flashinfer-only", action="store_true",
                        help="run the FlashInfer anchor section alone (pagedkv beside FlashInfer: decode, prefill, "
                             "FP8 decode) and write kernel_flashinfer.json")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="variants still waiting after this many seconds of the run are skipped")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8_e4m3", "fp8_e5m2"),
                        help="also time decode on an FP8 cache against the model-dtype one (B=64x4096, B=1x32768)")
    parser.add_argument("--fp8-only", action="store_true",
                        help="with --kv-dtype: run validation and the FP8 cases only")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU (checks the script, not the GPU): the torch path, or the Triton "
                             "kernels under the interpreter when TRITON_INTERPRET=1 is set")
    args = parser.parse_args(argv)

    import os

    import torch
    from rich.console import Console

    from pagedkv.bench import kernel_steps
    from pagedkv.bench.common import GPURequiredError
    from pagedkv.results import provenance, write_json

    console = Console(width=240)  # logs of a remote run are not a terminal: keep rows on one line
    if torch.cuda.is_available():
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, "triton"
        device_name = torch.cuda.get_device_name(device)
    elif args.smoke:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        device, dtype, backend = torch.device("cpu"), torch.float32, "triton" if interpret else "torch"
        device_name = f"cpu (smoke: {'Triton interpreter' if interpret else 'torch path'})"
    else:
        raise GPURequiredError("pagedkv bench kernel needs a CUDA GPU, and torch.cuda.is_available() is False; "
                               "--smoke exercises the script on CPU")
    started = time.perf_counter()

    def progress(message: str) -> None:
        console.print(f"[{time.perf_counter() - started:6.1f} s] {message}")

    result: dict = {"benchmark": "kernel", "dtype": str(dtype).removeprefix("torch."), "backend": backend}
    result["provenance"] = provenance(device=device_name)
    smoke = args.smoke or device.type != "cuda"

    if args.flashinfer_only:
        from pagedkv.bench import kernel_flashinfer

        result["flashinfer"] = kernel_flashinfer.anchor(device, dtype, backend, smoke, progress)
        if result["flashinfer"]["rows"]:
            _print_table(console, f"pagedkv beside FlashInfer {result['flashinfer']['version']}",
                         *kernel_flashinfer.table_rows(result["flashinfer"]))
        console.print(f"wrote {write_json(args.out, 'kernel_flashinfer', result)}")
        return 0

    invalid: set = set()
    if args.validate or not smoke or backend == "triton":
        result["validation"] = validate(device, dtype, backend, decode_variant_tunings(),
                                        prefill_variant_tunings(), unified_variant_tunings())
        invalid = failed_contenders(result["validation"])
        for row in result["validation"]:
            console.print(f"validate {row['kernel']:<8} {row['contender']:<32} {row['case']:<44} max abs err "
                          f"{row['max_abs_err']:.2e} (tol {row['tolerance']:.0e}): {'ok' if row['ok'] else 'FAILED'} "
                          f"{row['error']}")
        progress(f"validation: {len(result['validation'])} checks, {len(invalid)} contenders failed")

    result["copy_tbps"] = copy_bandwidth_tbps(device, 2 * 2**30 if device.type == "cuda" else 2**26)
    progress(f"copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s")
    if args.kv_dtype != "auto":
        from pagedkv.bench import kernel_fp8
        from pagedkv.kernels import KernelWorkspace

        result["fp8_decode"] = kernel_fp8.fp8_decode(device, dtype, backend, args.kv_dtype, result["copy_tbps"], smoke,
                                                     KernelWorkspace(64 * NUM_KV_HEADS, device), progress)
        _print_table(console, f"Paged decode, {args.kv_dtype} against {result['dtype']} caches, {device_name}",
                     *kernel_fp8.table_rows(result["fp8_decode"]))
        result["fp8_targets"] = kernel_fp8.target_rows(result["fp8_decode"])
        if args.fp8_only:
            result["target_summary"] = result["fp8_targets"]
            _print_table(console, "Targets", ["target", "measured", "met"],
                         [[t["target"], t["measured"], verdict(t["met"])] for t in result["target_summary"]])
            result["elapsed_s"] = time.perf_counter() - started
            console.print(f"wrote {write_json(args.out, 'kernel_fp8', result)} in {result['elapsed_s']:.0f} s")
            return 0
    result["decode"] = decode_grid(device, dtype, backend, GRID if not smoke else SMOKE_GRID, result["copy_tbps"],
                                   not args.no_flex and device.type == "cuda", invalid, progress)
    _print_table(console, f"Paged decode, Llama-3-8B attention, {result['dtype']} on {device_name}",
                 *_decode_table_rows(result["decode"]))

    result["write_kv"] = write_kv_bandwidth(device, dtype, backend, 16384 if not smoke else 256)
    prefill_shape = (8, 2048) if not smoke else (1, 64)
    result["prefill"] = prefill_throughput(device, dtype, backend, *prefill_shape)
    unified_prefill = prefill_throughput(device, dtype, backend, *prefill_shape, kernel="unified", with_sdpa=False)
    split_prefill = prefill_throughput(device, dtype, backend, *prefill_shape, kernel="split", with_sdpa=False)
    result["prefill_contenders"] = [{**result["prefill"], "label": "prefill kernel"},
                                    {**unified_prefill, "label": "unified kernel"},
                                    {**split_prefill, "label": "split kernel (engine)"}]
    w, p = result["write_kv"], result["prefill"]
    progress(f"write_kv {w['num_tokens']} tokens: {fmt(w['tbps'])} TB/s (read + write) {w['error']}")
    progress(f"prefill {p['batch']} x {p['seq_len']} causal: {fmt(p['tflops'], '.1f')} TFLOP/s (unified kernel "
             f"{fmt(unified_prefill['tflops'], '.1f')}, split kernel {fmt(split_prefill['tflops'], '.1f')}); "
             f"contiguous causal SDPA ({p['sdpa_backend']}) "
             f"{fmt(p['sdpa_causal_tflops'], '.1f')} TFLOP/s {p['error']}")

    result["steps"], result["step_targets"] = kernel_steps.run_steps(device, dtype, backend, smoke,
                                                                     result["copy_tbps"], invalid, progress)
    for title, section in result["steps"].items():
        _print_table(console, f"{title}: {section['note']}", section["header"], section["body"])

    if not args.no_flashinfer:
        from pagedkv.bench import kernel_flashinfer

        result["flashinfer"] = kernel_flashinfer.anchor(device, dtype, backend, smoke, progress)
        if result["flashinfer"]["rows"]:
            _print_table(console, f"pagedkv beside FlashInfer {result['flashinfer']['version']} (same pool, "
                                  f"same method)", *kernel_flashinfer.table_rows(result["flashinfer"]))

    if args.variants:
        result["variants"] = variants(device, dtype, backend, smoke, started + args.budget_s, invalid, progress)
        rows = result["variants"]["decode"]
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        best = {s: max((r["tbps"] or 0) for r in rows if r["shape"] == s) for s in shapes}
        by_variant: dict[str, dict[str, dict]] = {}
        for r in rows:
            by_variant.setdefault(r["variant"], {})[r["shape"]] = r
        _print_table(console, "Decode variants (TB/s, CUDA-graph replays; best per shape marked *)",
                     ["variant", *shapes],
                     [[name, *[fmt(cells[s]["tbps"], ".2f", (cells[s]["error"] or "n/a")[:30])
                               + ("*" if cells[s]["tbps"] and cells[s]["tbps"] == best[s] else "") for s in shapes]]
                      for name, cells in by_variant.items()])
        _print_table(console, f"Prefill variants, {prefill_shape[0]} x {prefill_shape[1]} causal",
                     ["variant", "kernel", "TFLOP/s"],
                     [[r["variant"], r.get("kernel", "prefill"), fmt(r["tflops"], ".1f", (r["error"] or "n/a")[:40])]
                      for r in result["variants"]["prefill"]])
        result["prefill_contenders"] += [{**r, "label": r["variant"] if r["variant"].startswith(r["kernel"])
                                          else f"{r['kernel']} {r['variant']}"}
                                         for r in result["variants"]["prefill"] if r.get("tflops")]

    result["target_summary"] = target_summary(result)
    _print_table(console, "Targets", ["target", "measured", "met"],
                 [[t["target"], t["measured"], verdict(t["met"])] for t in result["target_summary"]])
    result["elapsed_s"] = time.perf_counter() - started
    console.print(f"wrote {write_json(args.out, 'kernel', result)} and {write_markdown(Path(args.out), result)} "
                  f"in {result['elapsed_s']:.0f} s")
    return 0
