"""Is a batch-256 decode step (Qwen3-0.6B shape, bf16) bound by the GPU or by the host? A timeline answer.

Runs 256 streams into steady decode, then profiles 12 engine steps (torch.profiler, CPU + CUDA)
and reports: the step's host phases, the decode graph's replay time alone (CUDA events), the
GPU's busy share of the profiled window (union of kernel and copy intervals), every GPU idle gap
over 20 us with what ran before and after it, and the GPU time of everything outside the graph.
Writes OUT/b256_profile.md, OUT/b256_profile.json and a Chrome trace. Usage: python
benchmarks/tools/profile_b256.py OUT_DIR
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pagedkv import LLM, SamplingParams
from pagedkv.bench.common import graph_replay_ms
from pagedkv.engine.outputs import STEP_PHASES


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    batch = 256
    llm = LLM("random:qwen3-0.6b", dtype="bfloat16", max_model_len=4096, max_num_seqs=batch,
              max_num_batched_tokens=8192)
    engine = llm.engine
    engine.stream_outputs = False
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm.generate([[(i * 7 + j) % 5000 + 3 for j in range(128)] for i in range(batch)], params)  # warm-up
    for i in range(batch):
        engine.add_request(f"r{i}", [(i * 11 + j) % 5000 + 3 for j in range(128)], params)
    for _ in range(30):
        engine.step()
    graph = engine.runner.graphs[engine.runner._graph_for(batch)][0]
    torch.cuda.synchronize()
    replay_ms = graph_replay_ms(graph, 20)
    for _ in range(5):
        engine.step()
    engine.step_timings = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            engine.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / "b256_trace.json"))
    steps = [t for t in engine.step_timings if t.shape.decode_seqs == batch and t.shape.prefill_tokens == 0]
    phases = {name[:-2]: statistics.median(getattr(t, name) for t in steps) * 1e3
              for name in STEP_PHASES}
    step_ms = statistics.median(t.total_s for t in steps) * 1e3
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == DeviceType.CUDA)
    window = gpu[-1][1] - gpu[0][0]
    busy, gaps, cursor, last = 0.0, [], gpu[0][0], gpu[0][2]
    for start, end, name in gpu:
        if start > cursor:
            if start - cursor > 20:
                gaps.append({"us": start - cursor, "after": last[:60], "before": name[:60]})
            busy += end - start
        else:
            busy += max(0.0, end - cursor)
        if end > cursor:
            cursor, last = end, name
    by_name = defaultdict(float)
    for start, end, name in gpu:
        by_name[name[:70]] += (end - start) / 12
    result = {"batch": batch, "step_ms": step_ms, "phases_ms": phases, "graph_replay_ms": replay_ms,
              "gpu_busy_share": busy / window, "window_ms": window / 1e3, "gaps_over_20us": gaps,
              "gpu_us_per_step_by_kernel": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:40])}
    (out / "b256_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Batch-256 decode step, Qwen3-0.6B shape (bf16), {len(steps)} steps profiled", "",
             f"- step {step_ms:.3f} ms; " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()),
             f"- decode graph replay alone {replay_ms:.3f} ms",
             f"- GPU busy {100 * busy / window:.1f}% of the {window / 1e3:.1f} ms window; "
             f"{len(gaps)} idle gaps over 20 us, {sum(g['us'] for g in gaps) / 1e3:.2f} ms in all", "",
             "| gap us | after | before |", "|---|---|---|"]
    lines += [f"| {g['us']:.0f} | {g['after']} | {g['before']} |" for g in gaps[:40]]
    lines += ["", "| GPU us per step | kernel or copy |", "|---|---|"]
    lines += [f"| {us:.1f} | {name} |" for name, us in list(result["gpu_us_per_step_by_kernel"].items())[:40]]
    (out / "b256_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:60]))


if __name__ == "__main__":
    main()
