"""Where a batch-1 decode step of Llama-3-8B goes, whole (TP=1) and as one TP=2 rank's shard, on one GPU.

1. Each projection alone at M = 1 (and 64): F.linear over 8 distinct weight copies in turn (so
   L2 holds none of them), 40 calls captured in a CUDA graph: microseconds and GB/s of weights.
2. The engine's decode graph at batch 1: replay time (CUDA events), and a torch.profiler table
   of its kernels over 10 replays (GPU time by kernel name).
Usage: python benchmarks/tools/profile_tp_shard.py OUT_DIR  (writes tp_shard_profile.md and .json)
"""

import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from pagedkv import LLM, SamplingParams
from pagedkv.bench.common import graph_replay_ms
from pagedkv.bench.parallel import shard_model
from pagedkv.models.loader import RANDOM_CONFIGS


def graph_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return graph_replay_ms(graph, 10) * 1e3 / calls


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (cfg["vocab_size"], h)}


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    names = {"tp1": "random:llama3-8b", "tp2 shard": shard_model("random:llama3-8b", 2)}
    result: dict = {"projections": {}, "steps": {}}
    lines = ["# Llama-3-8B batch-1 decode: whole model against one TP=2 rank's shard (one H200, bf16)", "",
             "| projection | shape (out x in) | M | TP=1 us | GB/s | shard shape | shard us | GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    shapes = {k: projections(RANDOM_CONFIGS[v.split(":", 1)[1]]) for k, v in names.items()}
    for proj in shapes["tp1"]:
        for m in (1, 64):
            row = []
            for key in names:
                n, k = shapes[key][proj]
                weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(8)]
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                turn = iter(range(10**9))

                def call():
                    return F.linear(x, weights[next(turn) % 8])

                us = graph_us(call, 40)
                gbs = n * k * 2 / us / 1e3
                result["projections"][f"{key} {proj} M={m}"] = {"shape": [n, k], "us": us, "gb_per_s": gbs}
                row.append((f"{n} x {k}", us, gbs))
                del weights
            lines.append(f"| {proj} | {row[0][0]} | {m} | {row[0][1]:.1f} | {row[0][2]:.0f} | {row[1][0]} | "
                         f"{row[1][1]:.1f} | {row[1][2]:.0f} |")
    for key, model in names.items():
        llm = LLM(model, dtype="bfloat16", kv_cache_memory=8 * 2**30, max_model_len=1024, max_num_seqs=64)
        engine = llm.engine
        llm.generate([[5] * 128], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        graph = engine.runner.graphs[1][0]
        replay_ms = graph_replay_ms(graph, 30)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
        kernels_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 10 / 1e3
        result["steps"][key] = {"model": model, "replay_ms": replay_ms, "kernel_ms_per_replay": kernels_ms}
        lines += ["", f"## {key} ({model}): batch-1 graph replay {replay_ms:.3f} ms, kernels {kernels_ms:.3f} ms "
                      f"per replay", "", "```", table, "```"]
        engine.shutdown()
        del llm, engine, graph
        torch.cuda.empty_cache()
    (out / "tp_shard_profile.md").write_text("\n".join(lines) + "\n")
    (out / "tp_shard_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines[:16]))
    print(json.dumps(result["steps"]))


if __name__ == "__main__":
    main()
