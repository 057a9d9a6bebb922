"""Host time of PagedCache's drop-in path per decode step, the attention kernel stubbed out. Prints only.

What is left is what the cache adds on the host around the launch: `update` tagging the key,
the step's metadata (built once, on layer 0: block-table growth, slots, one host-to-device
copy), the K/V write (two `index_copy_`) and the attention function's own Python. GPT-2 124M
shape (12 layers, 12 heads of 64), on CUDA when there is one.

    PYTHONPATH=src python benchmarks/hf_host_overhead.py [--batch 1 32] [--device cpu]
"""

import argparse
import statistics
import time

import torch

import pagedkv.hf.attention as attention
from pagedkv.hf import PagedCache, PagePool


class _Layer:
    """What the attention function reads of an HF attention module."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx
        self.sliding_window = None


def _stub_decode(query, *args, out=None, **kwargs):
    return torch.empty_like(query) if out is None else out


def per_step_us(batch: int, device: str, num_layers: int = 12, num_heads: int = 12, head_dim: int = 64,
                steps: int = 300, rounds: int = 7) -> float:
    """The best over `rounds` of the median host time of one decode step."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    pool = PagePool(num_layers, num_heads, head_dim, num_blocks=batch * (steps + 32) // 16 + 64, block_size=16,
                    dtype=dtype, device=device)
    layers = [_Layer(i) for i in range(num_layers)]
    q, k, v = (torch.randn(batch, num_heads, 1, head_dim, dtype=dtype, device=device) for _ in range(3))
    mask = torch.ones(batch, 11, device=device)
    best = []
    with torch.no_grad():
        for _ in range(rounds):
            cache = PagedCache(pool)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                for layer in layers:
                    key, value = cache.update(k, v, layer.layer_idx)
                    attention.paged_attention_forward(layer, q, key, value, mask, scaling=0.125, dropout=0.0,
                                                      sliding_window=None)
                times.append(time.perf_counter() - start)
                if device == "cuda":
                    torch.cuda.synchronize()  # as generate's stop check does once per step
            cache.free()
            best.append(statistics.median(times[20:]) * 1e6)
    return min(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    attention.paged_decode_attention = _stub_decode  # measure everything but the kernel
    print("| batch | host us / decode step | us / layer |\n|---:|---:|---:|")
    for batch in args.batch:
        us = per_step_us(batch, args.device)
        print(f"| {batch} | {us:.0f} | {us / 12:.1f} |")


if __name__ == "__main__":
    main()
