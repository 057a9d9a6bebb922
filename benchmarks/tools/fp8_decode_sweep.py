"""FP8 decode: which conversion route and launch shape reads FP8 pages fastest? (H200; one JSON line per config)

The target is FP8 decode time <= 0.55x bf16. Before this sweep the split kernel took 1.29x at
B=64 x 4096: FP8 tiles went e4m3 -> f16 -> f32 -> bf16 per value before the bf16 dots. This
sweep times, per conversion route (chosen at import by PAGEDKV_FP8_CONVERT / PAGEDKV_FP8_COMPUTE,
so run one process per route), the split decode kernel over block_n x warps x stages, each
config first checked against the float64 reference, on `bench kernel`'s method (CUDA-graph
replays, L2 flushed). The bf16 default is timed in the same process as the baseline.

    PAGEDKV_FP8_CONVERT=fp32 PAGEDKV_FP8_COMPUTE=model   the 353542d route
    PAGEDKV_FP8_COMPUTE=model                           e4m3 -> f16 -> bf16, bf16 dots
    (defaults)                                          e4m3 -> f16, fp16 dots (bf16 query to fp16)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from pagedkv.bench.kernel_common import HEAD_DIM, kv_bytes, make_paged, max_abs_err, tbps, try_time_graphed
from pagedkv.bench.kernel_fp8 import quantized_caches
from pagedkv.kernels import DecodeTuning, paged_decode_attention, reference_decode_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-n", default="64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--schedule", default="split", choices=("split", "tiles"))
    parser.add_argument("--heads-per-program", default="1", help="tiles: kv heads per program (comma-separated)")
    args = parser.parse_args()
    route = f"convert={os.environ.get('PAGEDKV_FP8_CONVERT', 'direct')},compute={os.environ.get('PAGEDKV_FP8_COMPUTE', 'f16')}"
    device = torch.device("cuda")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    grid = list(itertools.product(ints(args.block_n), ints(args.warps), ints(args.stages),
                                  ints(args.heads_per_program)))
    for batch, seq_len in [(64, 4096), (1, 32768), (8, 4096)]:
        query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, 16, True, device, torch.bfloat16, seed=5)
        k8, v8, k_scale, v_scale = quantized_caches(k_cache, v_cache, torch.float8_e4m3fn)
        check = slice(0, min(batch, 2))
        expected = reference_decode_attention(query[check], k8, v8, table[check], lens[check],
                                              scale=HEAD_DIM ** -0.5, float64=True, k_scale=k_scale, v_scale=v_scale)
        base = dict(scale=HEAD_DIM ** -0.5, max_seq_len=seq_len, validate=False, backend="triton")
        bf16_ms, _ = try_time_graphed(lambda: paged_decode_attention(query, k_cache, v_cache, table, lens, **base),
                                      device)
        for block_n, warps, stages, heads in grid:
            tuning = DecodeTuning(block_n=block_n, num_warps=warps, num_stages=stages, fp8_block_n=None,
                                  fp8_num_warps=None, schedule=args.schedule, heads_per_program=heads)

            def call():
                return paged_decode_attention(query, k8, v8, table, lens, tuning=tuning, k_scale=k_scale,
                                              v_scale=v_scale, **base)
            row = {"route": route, "schedule": args.schedule, "batch": batch, "seq_len": seq_len, "block_n": block_n,
                   "warps": warps, "stages": stages, "heads_per_program": heads}
            try:
                row["err"] = max_abs_err(call()[check], expected)
                ms, error = try_time_graphed(call, device) if row["err"] < 2e-2 else (None, "wrong")
            except Exception as exc:  # noqa: BLE001 - a sweep reports and goes on
                ms, error = None, f"{type(exc).__name__}: {str(exc)[:80]}"
            row.update(fp8_us=ms and ms * 1e3, bf16_us=bf16_ms and bf16_ms * 1e3,
                       ratio=ms / bf16_ms if ms and bf16_ms else None,
                       fp8_tbps=tbps(kv_bytes(batch, seq_len, 1), ms), error=error)
            print(json.dumps(row), flush=True)
        del k8, v8, k_cache, v_cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
