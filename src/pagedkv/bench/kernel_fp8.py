"""The FP8 section of `pagedkv bench kernel --kv-dtype fp8_e4m3`: paged decode over FP8 and bf16 caches, one run.

For each case (B=64 x 4096 and B=1 x 32768, Llama-3-8B attention, page 16, shuffled tables)
the same K/V are stored twice: in the model dtype, and quantized to FP8 with per-head scales
from their absolute maxima (as calibration makes them). Every decode schedule is first
checked on the FP8 cache against the float64 reference (which dequantizes explicitly), then
timed on both caches with CUDA-graph replays, back to back. Reported per schedule:

    time ratio      FP8 time / model-dtype time              target <= 0.55
    FP8 bandwidth   K/V bytes at 1 byte per value / time     target >= 90% of copy at B=64 x 4096

Like the rest of `bench kernel`, it never asserts: each target is printed met or MISSED.
"""

from __future__ import annotations

import functools

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    LLAMA3,
    decode_contenders,
    describe,
    fmt,
    kv_bytes,
    make_paged,
    max_abs_err,
    tbps,
    tolerance_for,
    try_time_graphed,
)

FP8_CASES = [(64, 4096), (1, 32768)]
SMOKE_CASES = [(2, 256)]
#: FP8 decode time over model-dtype decode time, at most (docs/benchmarks.md).
TARGET_TIME_RATIO = 0.55
#: FP8 bandwidth (counted in FP8 bytes) over copy bandwidth, at least, at B=64 x 4096.
TARGET_COPY_FRACTION = 0.9


def quantized_caches(k_cache, v_cache, cache_dtype):
    """(k8, v8, k_scale, v_scale): the caches in FP8 with per-head scales mapping each head's amax to max / 2."""
    from pagedkv.kernels.fp8 import DEFAULT_HEADROOM, fp8_max, quantize

    num_kv_heads = k_cache.shape[2]
    top = fp8_max(cache_dtype) / DEFAULT_HEADROOM
    k_scale = (k_cache.abs().amax(dim=(0, 1, 3)).float() / top).contiguous()  # [Hkv]
    v_scale = (v_cache.abs().amax(dim=(0, 1, 3)).float() / top).contiguous()
    shape = k_cache.shape
    k8 = quantize(k_cache.reshape(-1, num_kv_heads, shape[-1]), k_scale, cache_dtype).view(shape)
    v8 = quantize(v_cache.reshape(-1, num_kv_heads, shape[-1]), v_scale, cache_dtype).view(shape)
    return k8, v8, k_scale, v_scale


def fp8_contenders():
    """The model-dtype default (split) first, then FP8's own default (tiles), then the other schedules."""
    from pagedkv.kernels import DecodeTuning

    contenders = decode_contenders()
    first = next(iter(contenders))
    return {first: contenders.pop(first), "tiles (FP8 default)": DecodeTuning(schedule="tiles"), **contenders}


def fp8_decode(device, dtype, backend: str, kv_cache_dtype: str, copy_tbps: float, smoke: bool, workspace,
               progress) -> list[dict]:
    """One row per (case, schedule): validation error, times on both caches, FP8 bandwidth, targets.

    `time_ratio` is the FP8 time over the model-dtype cache's default launch (split), the issue's comparison;
    `model_ms` is the model-dtype time of the row's own schedule."""
    import torch

    from pagedkv.kernels import paged_decode_attention, reference_decode_attention
    from pagedkv.kernels.fp8 import FP8_DTYPES

    cache_dtype = FP8_DTYPES[kv_cache_dtype]
    rows = []
    for batch, seq_len in SMOKE_CASES if smoke else FP8_CASES:
        query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, 16, True, device, dtype, seed=5)
        k8, v8, k_scale, v_scale = quantized_caches(k_cache, v_cache, cache_dtype)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        fp8_bytes = kv_bytes(batch, seq_len, 1, LLAMA3)
        model_bytes = kv_bytes(batch, seq_len, k_cache.element_size(), LLAMA3)
        # The reference loops over sequences: check a few rows of the batch, not all 64.
        check = slice(0, min(batch, 4))
        expected = reference_decode_attention(query[check], k8, v8, table[check], lens[check], scale=HEAD_DIM ** -0.5,
                                              float64=True, **scales)
        baseline_ms = None  # the model-dtype cache's default launch (split): what the time target compares with
        for index, (name, tuning) in enumerate(fp8_contenders().items()):
            call = functools.partial(paged_decode_attention, scale=HEAD_DIM ** -0.5, max_seq_len=seq_len,
                                     validate=False, backend=backend, tuning=tuning, workspace=workspace)
            row = {"batch": batch, "seq_len": seq_len, "page": 16, "kv_cache_dtype": kv_cache_dtype, "schedule": name,
                   "fp8_kv_bytes": fp8_bytes, "model_kv_bytes": model_bytes}
            try:
                err = max_abs_err(call(query, k8, v8, table, lens, **scales)[check], expected)
            except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
                err, row["error"] = float("inf"), describe(error)
            row["max_abs_err"], row["ok"] = err, err <= tolerance_for(dtype)
            if row["ok"]:
                row["model_ms"], model_error = try_time_graphed(lambda: call(query, k_cache, v_cache, table, lens),
                                                                device)
                row["fp8_ms"], fp8_error = try_time_graphed(lambda: call(query, k8, v8, table, lens, **scales), device)
                row["error"] = fp8_error or model_error
            fp8_ms, model_ms = row.get("fp8_ms"), row.get("model_ms")
            if index == 0:
                baseline_ms = model_ms
            row["model_default_ms"] = baseline_ms
            row["time_ratio"] = fp8_ms / baseline_ms if fp8_ms and baseline_ms else None
            row["fp8_tbps"] = tbps(fp8_bytes, fp8_ms)
            row["model_tbps"] = tbps(model_bytes, model_ms)
            row["fp8_copy_fraction"] = row["fp8_tbps"] / copy_tbps if row["fp8_tbps"] else None
            row["targets"] = _targets(row)
            rows.append(row)
            progress(f"fp8 decode B={batch} L={seq_len} {name}: err {err:.1e}, {kv_cache_dtype} "
                     f"{_ms(fp8_ms)} vs the model dtype's default {_ms(baseline_ms)} ({fmt(row['time_ratio'])}x), "
                     f"{fmt(row['fp8_tbps'])} TB/s in FP8 bytes {row.get('error') or ''}")
        del k8, v8, k_cache, v_cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _ms(ms) -> str:
    return "n/a" if ms is None else f"{ms * 1e3:.1f} us"


def _targets(row: dict) -> list[str]:
    results = [f"<={TARGET_TIME_RATIO}x model-dtype time: "
               f"{'met' if (row['time_ratio'] or 1e9) <= TARGET_TIME_RATIO else 'MISSED'} ({fmt(row['time_ratio'])}x)"]
    if (row["batch"], row["seq_len"]) == (64, 4096):
        fraction = row["fp8_copy_fraction"]
        results.append(f">={TARGET_COPY_FRACTION:.0%} copy BW in FP8 bytes: "
                       f"{'met' if (fraction or 0) >= TARGET_COPY_FRACTION else 'MISSED'} "
                       f"({fmt(row['fp8_tbps'])} TB/s = {fmt(fraction and 100 * fraction, '.0f')}%)")
    return results


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, body) of the FP8 decode table."""
    header = ["B", "L", "schedule", "max abs err", "model-dtype us", "fp8 us", "fp8/model default",
              "fp8 TB/s (FP8 bytes)", "% copy", "targets"]
    body = [[str(r["batch"]), str(r["seq_len"]), r["schedule"], f"{r['max_abs_err']:.1e}",
             fmt(r.get("model_ms") and r["model_ms"] * 1e3, ".1f"), fmt(r.get("fp8_ms") and r["fp8_ms"] * 1e3, ".1f"),
             fmt(r["time_ratio"]), fmt(r["fp8_tbps"]), fmt(r["fp8_copy_fraction"] and 100 * r["fp8_copy_fraction"],
                                                              ".0f"),
             "; ".join(r["targets"]) + (f" [{r['error']}]" if r.get("error") else "")] for r in rows]
    return header, body


def target_rows(rows: list[dict]) -> list[dict]:
    """The FP8 targets for `bench kernel`'s summary: the default schedule's row and the best schedule's."""
    summary = []
    for batch, seq_len in dict.fromkeys((r["batch"], r["seq_len"]) for r in rows):
        case = [r for r in rows if (r["batch"], r["seq_len"]) == (batch, seq_len)]
        timed = [r for r in case if r["time_ratio"] is not None]
        best = min(timed, key=lambda r: r["fp8_ms"]) if timed else case[0]
        for text in best["targets"]:
            name, _, rest = text.partition(": ")
            summary.append({"target": f"fp8 decode B={batch} x {seq_len}: {name}", "met": rest.startswith("met"),
                            "measured": rest.partition(" ")[2].strip("()") + f", {best['schedule']}"})
    return summary
