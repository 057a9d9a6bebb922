"""Eager engine steps with bound Triton launches against Triton's own launch path, same machine, same run.

Runs the Qwen3-0.6B shape (bf16) with CUDA graphs off, so every step launches each kernel from
Python: decode steps at batch 1 and 64, and mixed steps (64 decodes plus a 512-token prefill
chunk). Each mode runs in its own process; "triton" turns bound launches off (every launch
through `kernel[grid](...)`, as before they were bound). Prints one JSON line per mode and
writes OUT.json. Usage: python benchmarks/tools/eager_launch_ab.py OUT.json
"""

import json
import os
import statistics
import subprocess
import sys


def run(mode: str) -> dict:
    import torch

    from pagedkv.kernels import launch, layer_ops

    if mode == "triton":
        launch._is_compiled = lambda fn: False
        for kernel in (fused._ADD_RMS_NORM, fused._QK_NORM_ROPE_WRITE, fused._SILU_MUL):
            kernel.bindable = False
    from pagedkv import LLM, SamplingParams

    llm = LLM("random:qwen3-0.6b", dtype="bfloat16", enforce_eager=True, max_model_len=2048, max_num_seqs=128,
              max_num_batched_tokens=2048)
    engine = llm.engine
    engine.stream_outputs = False
    result = {"mode": mode}
    for batch in (1, 64):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        llm.generate([[(i * 7 + j) % 5000 + 3 for j in range(64)] for i in range(batch)], params)  # warm-up
        engine.step_timings = []
        llm.generate([[(i * 5 + j) % 5000 + 3 for j in range(64)] for i in range(batch)], params)
        steps = [t for t in engine.step_timings if t.shape.prefill_tokens == 0 and t.shape.decode_seqs == batch]
        result[f"decode_b{batch}_ms"] = statistics.median(t.total_s for t in steps) * 1e3
    # Mixed: 64 running decodes, then a 512-token prompt arriving every step.
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"d{i}", [(i * 3 + j) % 5000 + 3 for j in range(32)], params)
    for _ in range(4):
        engine.step()
    engine.step_timings = []
    for k in range(24):
        engine.add_request(f"p{k}", [(k * 11 + j) % 5000 + 3 for j in range(512)],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        engine.step()
    if os.environ.get("AB_PROFILE_DIR"):  # where a mixed step's host and device time go, per mode
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k in range(6):
                engine.add_request(f"q{k}", [(k * 13 + j) % 5000 + 3 for j in range(512)],
                                   SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                engine.step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in averages) / 6 / 1e3
        result["profiled_gpu_ms_per_mixed_step"] = gpu_ms
        path = os.path.join(os.environ["AB_PROFILE_DIR"], f"eager_mixed_{mode}.txt")
        with open(path, "w") as f:
            f.write(averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
            f.write("\n\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    mixed = [t for t in engine.step_timings if t.shape.prefill_tokens and t.shape.decode_seqs]
    result["mixed_steps"] = len(mixed)
    result["mixed_ms"] = statistics.median(t.total_s for t in mixed) * 1e3
    result["mixed_launch_ms"] = statistics.median(t.launch_s for t in mixed) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    kernels = [fused._ADD_RMS_NORM, fused._QK_NORM_ROPE_WRITE, fused._SILU_MUL, *launch._BOUND.values()]
    bound, through_triton = (sum(k.launch_counts[i] for k in kernels) for i in (0, 1))
    result["launches"] = {"bound": bound, "through_triton": through_triton}
    torch.cuda.synchronize()
    return result


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--mode":
        print("RESULT " + json.dumps(run(sys.argv[2])), flush=True)
        return
    out = sys.argv[1] if len(sys.argv) > 1 else "eager_launch_ab.json"
    results = []
    for mode in ("triton", "bound"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True,
                              env=os.environ)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(proc.stderr[-3000:])
            continue
        results.append(json.loads(line[len("RESULT "):]))
        print(json.dumps(results[-1]), flush=True)
    with open(out, "w") as f:
        json.dump({"benchmark": "eager_launch_ab", "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
