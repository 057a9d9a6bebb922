#!/usr/bin/env bash
# Gemma 3, Gemma 2, Phi-3 and GPT-2 on pagedkv's own decoder: correctness on CUDA, then speed on a Gemma 3 shape.
#
# Run from the repository root on the GPU machine: `OUT=/tmp/out bash benchmarks/tools/families.sh` (~4 min;
# the stages' timeouts cap it at about 6).
#   1. the GPU-marked tests of the families (engine == HF generate in fp32, own decoder with and without CUDA
#      graphs, prompts and generations past 8-token windows) and of the windowed kernels (every attention
#      path against a float64 reference, blocks before the window poisoned);
#   2. `bench engine` on nano-vllm's workload (256 requests, 100-1024 in and out) on random:gemma3-1b (bf16,
#      512-token windows on 5 of 6 layers, max_model_len 4096): own decoder with CUDA graphs against the
#      HF-module path (target >= 5x); HF's continuous batching, the eager variant and most of the cost-model
#      calibration are skipped to fit the time;
#   3. `bench latency` on random:gemma3-1b: the decode step at batch 1 and 64 against its roofline.
# Writes $OUT/families.json and $OUT/families.md (the summary), each stage's own JSON/markdown/log under
# $OUT/families/, and $OUT/results.tgz. Environment: $OUT (default /tmp/out), $MODEL (default gemma3-1b).
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-gemma3-1b}
PY=${PYTHON:-python3}
start_log "$OUT/families"

timeout 120 $PYTEST -m gpu tests/models/test_models.py::test_engine_on_cuda_equals_hf_generate_fp32 \
  tests/kernels/test_kernels_window.py -k "((gemma or phi3 or gpt2) and own) or window" > "$R/tests.log" 2>&1
say "tests: exit $? $(tail -n 1 "$R/tests.log")"

timeout 170 $PY -m pagedkv bench engine --model "$MODEL" --skip-hf --skip pagedkv_eager --calibration-requests 8 \
  --out "$R/engine" > "$R/engine.log" 2>&1
say "bench engine: exit $? $(grep -E 'output tok/s' "$R/engine.log" | tr -s ' ' | tr '\n' ' ')"

timeout 60 $PY -m pagedkv bench latency --models "$MODEL:1,64" --impls pagedkv --no-hf-compiled --out "$R/latency" \
  > "$R/latency.log" 2>&1
say "bench latency: exit $? $(grep -E 'roofline' "$R/latency.log" | tr -s ' ' | tr '\n' ' ' | cut -c1-300)"

$PY - "$R" "$OUT" "$MODEL" <<'EOF'
import json, sys
from pathlib import Path

results, out, model = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


engine, latency = load(results / "engine/engine.json"), load(results / "latency/latency.json")
tests = (results / "tests.log").read_text().strip().splitlines()
summary = {"model": f"random:{model} (bf16)", "tests": tests[-1] if tests else "no output", "engine": {},
           "latency": []}
lines = [f"# Families on the own decoder: random:{model} (bf16)", "", f"GPU tests: {summary['tests']}", ""]
if engine:
    own, hf = engine.get("pagedkv", {}), engine.get("pagedkv_hf_modules", {})
    summary["engine"] = {"own_decoder_tok_s": own.get("output_tokens_per_s"),
                         "hf_modules_tok_s": hf.get("output_tokens_per_s"), "greedy_check": engine.get("greedy_check"),
                         "provenance": engine.get("provenance")}
    if own.get("output_tokens_per_s") and hf.get("output_tokens_per_s"):
        summary["engine"]["speedup"] = own["output_tokens_per_s"] / hf["output_tokens_per_s"]
    lines += ["| nano-vllm workload | output tok/s |", "|---|---:|"]
    for name, row in (("own decoder, CUDA graphs", own), ("HF modules, pagedkv attention", hf)):
        value = row.get("output_tokens_per_s")
        lines.append(f"| {name} | {value:,.0f} |" if value else f"| {name} | n/a ({row.get('error', 'missing')}) |")
    if "speedup" in summary["engine"]:
        lines.append(f"\nOwn decoder / HF modules: {summary['engine']['speedup']:.2f}x (target >= 5x)")
else:
    lines.append("bench engine: no result (see families/engine.log)")
if latency:
    for model_result in latency["models"]:
        for case in model_result["impls"].get("pagedkv", {}).get("cases", []):
            summary["latency"].append({k: case.get(k) for k in ("batch", "step_ms", "roofline_ms", "vs_roofline")})
    lines += ["", "| batch | ms/step | roofline ms | x roofline |", "|---:|---:|---:|---:|"]
    lines += [f"| {c['batch']} | {c['step_ms']:.2f} | {c['roofline_ms']:.2f} | {c['vs_roofline']:.2f} |"
              for c in summary["latency"] if c.get("step_ms") is not None]
else:
    lines.append("bench latency: no result (see families/latency.log)")
(out / "families.json").write_text(json.dumps(summary, indent=2) + "\n")
(out / "families.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "summary: exit $?"
finish_log
