"""Decode with keys as the mma's rows (`DecodeTuning.keys_as_rows`): S^T = K Q^T and O^T = V^T P^T against the
usual Q K^T and P V, on the split and tiles schedules, bf16 and FP8 caches (H200; one JSON line per config).

Each config is checked against the float64 reference on two rows before it is timed (CUDA-graph replays, L2
flushed, `bench kernel`'s method). Llama-3-8B attention (32 q heads, 8 KV heads, d128), page 16, shuffled pages.
"""

from __future__ import annotations

import json

import torch

from pagedkv.bench.kernel import HEAD_DIM, kv_bytes, make_paged, max_abs_err, tbps, try_time_graphed
from pagedkv.bench.kernel_fp8 import quantized_caches
from pagedkv.kernels import DecodeTuning, paged_decode_attention, reference_decode_attention

BF16 = {
    "split": DecodeTuning(),
    "split kar": DecodeTuning(keys_as_rows=True),
    "split kar w2": DecodeTuning(keys_as_rows=True, num_warps=2),
    "tiles": DecodeTuning(schedule="tiles"),
    "tiles kar": DecodeTuning(schedule="tiles", keys_as_rows=True),
    "tiles kar w2": DecodeTuning(schedule="tiles", keys_as_rows=True, num_warps=2),
}
FP8 = {
    "split n128 w2": DecodeTuning(schedule="split"),
    "split kar n64 w2": DecodeTuning(keys_as_rows=True, fp8_block_n=64),
    "split kar n64 w4": DecodeTuning(keys_as_rows=True, fp8_block_n=64, fp8_num_warps=4),
    "tiles n64 w2": DecodeTuning(schedule="tiles"),
    "tiles kar n64 w2": DecodeTuning(schedule="tiles", keys_as_rows=True),
    "tiles kar n64 w4": DecodeTuning(schedule="tiles", keys_as_rows=True, fp8_num_warps=4),
}


def main() -> None:
    device = torch.device("cuda")
    for batch, seq_len in [(64, 4096), (1, 32768), (8, 4096), (64, 512), (256, 512)]:
        query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, 16, True, device, torch.bfloat16, seed=5)
        k8, v8, k_scale, v_scale = quantized_caches(k_cache, v_cache, torch.float8_e4m3fn)
        check = slice(0, min(batch, 2))
        base = dict(scale=HEAD_DIM ** -0.5, max_seq_len=seq_len, validate=False, backend="triton")
        for kv, configs, caches, scales in (("bf16", BF16, (k_cache, v_cache), {}),
                                            ("fp8", FP8, (k8, v8), {"k_scale": k_scale, "v_scale": v_scale})):
            expected = reference_decode_attention(query[check], *caches, table[check], lens[check],
                                                  scale=HEAD_DIM ** -0.5, float64=True, **scales)
            for name, tuning in configs.items():
                def call():
                    return paged_decode_attention(query, *caches, table, lens, tuning=tuning, **scales, **base)
                row = {"kv": kv, "config": name, "batch": batch, "seq_len": seq_len}
                try:
                    row["err"] = max_abs_err(call()[check], expected)
                    ms, error = try_time_graphed(call, device) if row["err"] < 2e-2 else (None, "wrong")
                except Exception as exc:  # noqa: BLE001 - a sweep reports and goes on
                    ms, error = None, f"{type(exc).__name__}: {str(exc)[:80]}"
                nbytes = kv_bytes(batch, seq_len, 1 if kv == "fp8" else 2)
                row.update(us=ms and ms * 1e3, tbps=tbps(nbytes, ms), error=error)
                print(json.dumps(row), flush=True)
        del k8, v8, k_cache, v_cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
