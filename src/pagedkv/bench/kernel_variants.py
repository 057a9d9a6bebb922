"""`pagedkv bench kernel --variants`: alternative launch configurations timed side by side.

Decode schedules on the shapes that carry targets (CUDA-graph replays), prefill tiles and
unified-kernel tunings on 8 x 2048 causal. A variant that failed validation is reported as
such; those still waiting past the time budget are reported as skipped, so the whole run
fits one GPU call.
"""

from __future__ import annotations

import functools
import time

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    NUM_KV_HEADS,
    kv_bytes,
    make_paged,
    tbps,
    try_time_graphed,
    unified_variant_tunings,
)
from pagedkv.bench.kernel_prefill import prefill_throughput


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
