"""Can two processes all-reduce over NCCL through torch.distributed, eagerly and inside a CUDA graph?

The smallest check under tensor parallelism: if this hangs or fails, the engine's TP cannot work.
Usage: python benchmarks/tools/tp_probe.py  (needs two GPUs; prints one line per rank and step).
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, init_method: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(40, exit=True)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30), device_id=device)
    control = dist.new_group(backend="gloo")
    x = torch.full((4096,), float(rank + 1), device=device, dtype=torch.bfloat16)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"rank {rank}: eager all_reduce -> {x[0].item()} (want 3.0)", flush=True)
    box = [f"hello from {rank}"]
    dist.broadcast_object_list(box, src=0, group=control)
    print(f"rank {rank}: gloo broadcast -> {box[0]}", flush=True)
    static = torch.ones(4096, device=device, dtype=torch.bfloat16)
    y = static * 2  # warm-up on a side stream like capture does
    dist.all_reduce(y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = static * 2
        dist.all_reduce(y)
    torch.cuda.synchronize()
    print(f"rank {rank}: captured", flush=True)
    static.fill_(float(rank + 1))
    graph.replay()
    torch.cuda.synchronize()
    print(f"rank {rank}: graph all_reduce -> {y[0].item()} (want 6.0)", flush=True)
    start = time.perf_counter()
    for _ in range(1000):
        graph.replay()
    torch.cuda.synchronize()
    print(f"rank {rank}: graph replay with all_reduce {1e3 * (time.perf_counter() - start):.1f} us", flush=True)
    # Destroying the group while a graph holding its collective is alive hangs in the NCCL
    # teardown (torch 2.11, two H200s): drop the graph first.
    del graph
    torch.cuda.synchronize()
    dist.destroy_process_group()
    print(f"rank {rank}: group destroyed", flush=True)


def main() -> None:
    if torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(_rank_main, args=("tcp://127.0.0.1:29533",), nprocs=2, join=True)


if __name__ == "__main__":
    main()
