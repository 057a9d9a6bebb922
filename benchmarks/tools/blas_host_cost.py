"""Host and device time of one bf16 projection call (F.linear), with torch's cuBLASLt path and with cuBLAS.

An eager engine step makes four projection calls per layer; with bound Triton launches their host
time (~25 us each under the profiler) is most of what is left of a mixed step's host time. For the
Qwen3-0.6B projections at 1, 64 and 576 rows: host microseconds per call (median of 20 runs of 100 calls,
fewer than the launch queue holds) and device microseconds per call (CUDA events over 200 calls), per BLAS library.
Usage: python benchmarks/tools/blas_host_cost.py OUT.json
"""

import json
import statistics
import sys
import time

import torch
from torch.nn import functional as F

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def measure(library: str) -> dict:
    torch.backends.cuda.preferred_blas_library(library)
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        for m in (1, 64, 576):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            for _ in range(50):
                F.linear(x, w)
            samples = []
            for _ in range(20):  # 100 calls: fewer than the launch queue holds, so the host never waits
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(100):
                    F.linear(x, w)
                samples.append((time.perf_counter() - start) / 100 * 1e6)
            host_us = statistics.median(samples)
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(200):
                F.linear(x, w)
            end.record()
            end.synchronize()
            out[f"{name} M={m}"] = {"host_us": host_us, "device_us": begin.elapsed_time(end) * 1e3 / 200}
    return out


def main() -> None:
    result = {"cublaslt": measure("cublaslt"), "cublas": measure("cublas")}
    for key in result["cublaslt"]:
        a, b = result["cublaslt"][key], result["cublas"][key]
        print(f"{key:14s} host {a['host_us']:6.1f} -> {b['host_us']:6.1f} us   device {a['device_us']:6.1f} -> "
              f"{b['device_us']:6.1f} us")
    with open(sys.argv[1] if len(sys.argv) > 1 else "blas_host_cost.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
