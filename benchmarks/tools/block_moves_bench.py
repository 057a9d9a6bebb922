"""Whole-block gather and scatter of the KV tiers (`pagedkv.kernels.block_moves`): Triton against torch.

    PYTHONPATH=src python3 benchmarks/tools/block_moves_bench.py --out $OUT   (1 GPU)

On a Qwen3-0.6B-shaped pool (28 layers, 8 KV heads, head_dim 128, 16-token blocks, bf16: 1.84 MB a
block) and a Llama-3-8B-shaped one, for moves of n blocks (random distinct ids in a pool of 4,096):
each kernel's device time (`pagedkv.bench.kernel_common.try_time`: do_bench's median, L2 flushed; the
results at 7aaf22a used CUDA events around each call, L2 warm) as block bytes per second, beside a contiguous
device-to-device copy of the same bytes, and each call's host time (the mean of 200 calls issued
back to back, no sync between them). Bytes are checked equal to the torch reference first. Prints a
markdown table and writes block_moves.json; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pagedkv.bench.kernel_common import try_time
from pagedkv.kernels.block_moves import (
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
)

SHAPES = {"qwen3-0.6b": (28, 16, 8, 128), "llama3-8b": (32, 16, 8, 128)}  # L, B, Hkv, D
POOL_BLOCKS = 4096
MOVES = (16, 39, 128, 512)


def host_seconds(fn, calls: int = 200) -> float:
    """Mean host time of one call of `fn()`, calls issued back to back (the device catches up after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


def moves(storage, ids, staged, out) -> dict:
    """The calls timed for one move of len(ids) blocks, by name."""
    flat_src, flat_dst = staged.view(-1), out.view(-1)
    return {
        "gather triton": lambda: gather_blocks(storage, ids, out),
        "gather torch": lambda: gather_blocks_reference(storage, ids),
        "scatter triton": lambda: scatter_blocks(storage, ids, staged),
        "scatter torch": lambda: scatter_blocks_reference(storage, ids, staged),
        "contiguous copy": lambda: flat_dst.copy_(flat_src),
    }


def run(name: str, shape: tuple[int, int, int, int]) -> list[dict]:
    num_layers, block_size, num_kv_heads, head_dim = shape
    storage = torch.randn((2, num_layers, POOL_BLOCKS, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16,
                          device="cuda")
    block_nbytes = storage[:, :, 0].numel() * storage.element_size()
    rows = []
    for n in MOVES:
        ids = torch.randperm(POOL_BLOCKS, device="cuda")[:n].contiguous()
        staged = torch.randn((n, 2, num_layers, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16,
                             device="cuda")
        out = torch.empty_like(staged)
        same_gather = torch.equal(gather_blocks(storage, ids, out).view(torch.uint8),
                                  gather_blocks_reference(storage, ids).view(torch.uint8))
        expected = storage.clone()
        scatter_blocks_reference(expected, ids, staged)
        scatter_blocks(storage, ids, staged)
        same_scatter = torch.equal(storage.view(torch.uint8), expected.view(torch.uint8))
        del expected
        cases = moves(storage, ids, staged, out)
        row = {"model": name, "blocks": n, "block_bytes": block_nbytes, "same_gather": same_gather,
               "same_scatter": same_scatter}
        for case, fn in cases.items():
            fn()
            ms, why = try_time(fn, storage.device)  # the project's kernel timing: do_bench, L2 flushed
            if ms is None:
                row[case] = {"error": why}
                continue
            seconds = ms / 1e3
            row[case] = {"device_us": seconds * 1e6, "gb_per_s": n * block_nbytes / seconds / 1e9,
                         "host_us": host_seconds(fn) * 1e6}
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    rows = [row for name, shape in SHAPES.items() for row in run(name, shape)]
    cases = ["gather triton", "gather torch", "scatter triton", "scatter torch", "contiguous copy"]
    lines = [f"# Block moves on {torch.cuda.get_device_name()}", "",
             "block bytes moved per second of device time (GB/s), and host us per call",
             "", "| model | blocks | bytes equal | " + " | ".join(cases) + " |",
             "|---|---:|---|" + "---:|" * len(cases)]
    for row in rows:
        cells = [row[c]["error"] if "error" in row[c] else f"{row[c]['gb_per_s']:,.0f} GB/s, {row[c]['host_us']:.1f} us"
                 for c in cases]
        same = "yes" if row["same_gather"] and row["same_scatter"] else "NO"
        lines.append(f"| {row['model']} | {row['blocks']} | {same} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "block_moves.md").write_text(text)
    (out / "block_moves.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                     indent=1))


if __name__ == "__main__":
    main()
