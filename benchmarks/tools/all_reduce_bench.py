"""Per-call time of the engine's activation all-reduce (`TensorParallel.all_reduce`) inside CUDA graphs.

For each mode (NCCL's ring, torch's symmetric-memory one-shot) and message size, two processes
capture 16 back-to-back all-reduces of a bf16 [rows, 4096] activation in one graph, check the sum,
and time 50 replays, less the same chain's elementwise kernels alone. Sizes are the decode steps
of Llama-3-8B at batch 1, 64, 256 and 512, and a prefill chunk of 8,192 tokens (past the one-shot
limit: both modes run NCCL there).
Usage: python benchmarks/tools/all_reduce_bench.py OUT.jsonl   (needs two GPUs)
"""
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

ROWS = (1, 64, 256, 512, 8192)
CALLS_PER_GRAPH = 16


def _per_call_us(graph) -> float:
    """Microseconds per captured call: 50 replays of `graph` after 5 warm-up replays, wall clock."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 50 / CALLS_PER_GRAPH * 1e6


def _rank_main(rank: int, mode: str, init_method: str, out: str) -> None:
    import faulthandler

    from pagedkv.distributed.parallel import ParallelConfig, TensorParallel

    faulthandler.dump_traceback_later(120, exit=True)
    os.environ["PAGEDKV_TP_ALL_REDUCE"] = mode
    tp = TensorParallel(ParallelConfig(2, rank, init_method, "cuda", timeout_s=60))
    for rows in ROWS:
        x = torch.full((rows, 4096), float(rank + 1), device=tp.device, dtype=torch.bfloat16)
        outs = []
        for _ in range(2):  # warm-up outside the capture
            y = tp.all_reduce(x.clone())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x
            for _ in range(CALLS_PER_GRAPH):
                y = tp.all_reduce(y * 0.5)  # each call's input is the last output: a dependent chain
                outs.append(y)
        graph.replay()
        torch.cuda.synchronize()
        want = 3.0 * 0.5 * (2 * 0.5) ** (CALLS_PER_GRAPH - 1)  # (1 + 2) / 2 first, then (s/2 + s/2) = s
        ok = bool(torch.allclose(outs[-1].float(), torch.full_like(outs[-1].float(), want)))
        per_call_us = _per_call_us(graph)
        scale_graph = torch.cuda.CUDAGraph()  # the same chain without the all-reduces: subtracted
        with torch.cuda.graph(scale_graph):
            z = x
            for _ in range(CALLS_PER_GRAPH):
                z = z * 0.5
        scale_us = _per_call_us(scale_graph)
        if rank == 0:
            line = {"mode": mode, "path": tp.all_reduce_mode, "rows": rows, "bytes": rows * 4096 * 2,
                    "per_call_us": per_call_us - scale_us, "scale_us": scale_us, "sum_ok": ok}
            print(json.dumps(line), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(line) + "\n")
        del graph, scale_graph, outs
        torch.cuda.synchronize()
    tp.shutdown()


def main() -> None:
    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        sys.exit(2)
    from pagedkv.distributed.executor import free_tcp_address

    out = sys.argv[1] if len(sys.argv) > 1 else "all_reduce.jsonl"
    for mode in ("nccl", "symm_mem"):
        mp.start_processes(_rank_main, args=(mode, free_tcp_address(), out), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
