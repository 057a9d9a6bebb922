#!/usr/bin/env bash
# Piecewise CUDA graphs on one GPU: the GPU tests that cover them, the mixed-step A/B, and the engine
# on nano-vllm's workload with and without them. Results under $OUT (results.tgz + summary.log).
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
start_log "$OUT/piecewise"
say "commit $PAGEDKV_COMMIT; $(nvidia-smi -L | head -1)"
$PYTEST -m gpu tests/engine/test_piecewise_graphs.py tests/models > "$R/gpu_tests.log" 2>&1
say "gpu tests: exit $? ($(tail -1 "$R/gpu_tests.log"))"
python3 benchmarks/tools/mixed_step.py "$R" > "$R/mixed_step.log" 2>&1
say "mixed step: exit $?"; grep -E "captured|^full|^piecewise|^decode|^eager|^mode" "$R/mixed_step.log" | tee -a "$R/summary.log"
python3 -m pagedkv bench engine --skip-hf --skip pagedkv_eager,pagedkv_hf_modules --out "$R/engine" > "$R/engine.log" 2>&1
say "bench engine: exit $?"; grep -E "output tok/s" "$R/engine.log" | tee -a "$R/summary.log"
finish_log
