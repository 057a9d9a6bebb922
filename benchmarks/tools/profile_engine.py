"""Where an engine decode step's time goes, at batch 1 and 256 (Qwen3-0.6B shape, bf16). Writes tables to OUT.

For each batch: the step's host phases from `LLMEngine.step_timings`, the GPU time of one decode
graph replay (CUDA events, the forward alone), and a torch.profiler table of the eager forward's
kernels (GPU time by kernel). Usage: python benchmarks/tools/profile_engine.py OUT_DIR
"""

import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pagedkv import LLM, SamplingParams
from pagedkv.bench.common import graph_replay_ms
from pagedkv.engine.outputs import STEP_PHASES
from pagedkv.hf import random_model

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out_dir.mkdir(parents=True, exist_ok=True)
model = random_model("qwen3-0.6b", torch.bfloat16, "cuda")
lines = ["# Engine decode step profile (Qwen3-0.6B shape, bf16, 128-token prompts)", ""]
for eager in (False, True):
    llm = LLM(hf_model=model, num_blocks=256 * 26 + 64, max_model_len=1024, max_num_seqs=256,
              enforce_eager=eager)
    engine = llm.engine
    for batch in (1, 256):
        prompts = [[(i * 7 + j) % 5000 + 3 for j in range(128)] for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b{batch}-{i}", prompt, params)
        for _ in range(20):  # through the prefill chunks (2048 tokens a step) into pure decode steps
            engine.step()
        engine.step_timings = []
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
        label = "eager" if eager else "graphs"
        if not eager:
            size = engine.runner._graph_for(batch)
            graph = engine.runner.graphs[size][0]
            lines.append(f"- batch {batch}, {label}: decode graph replay (the forward alone, GPU) "
                         f"{graph_replay_ms(graph, 20):.3f} ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                engine.step()
            torch.cuda.synchronize()
        steps = [t for t in engine.step_timings if t.shape.prefill_tokens == 0]
        engine.step_timings = None
        phases = {name: statistics.median(getattr(t, name) for t in steps) * 1e3
                  for name in STEP_PHASES}
        total = statistics.median(t.total_s for t in steps) * 1e3
        lines.append(f"- batch {batch}, {label}: step {total:.3f} ms; " +
                     ", ".join(f"{k[:-2]} {v:.3f}" for k, v in phases.items()))
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
        (out_dir / f"engine_profile_{label}_b{batch}.txt").write_text(table)
        while engine.has_unfinished_requests():
            engine.step()
    del llm, engine
    torch.cuda.empty_cache()
(out_dir / "engine_profile_summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
