#!/usr/bin/env bash
# The GPU checks of the newest engine changes, in one call (about 4 minutes on one H200):
#   1. GPU tests: mixed-step graphs captured for every family (tiny Gemma 3's layer groups included), the
#      split and Gluon prefill kernels against float64 on the shared shuffled layout, layer groups, the KV tiers'
#      CUDA copy path (layer groups included), scheduling, the drop-in cache's CUDA paths (pinned staging,
#      the fused decode write) and the K/V write kernels;
#   2. `bench latency` on random:gemma3-1b: the decode step at batch 1 and 64 against its roofline;
#   3. `stop_strings_async.py`: nano-vllm's workload with stop strings on every request, against async and
#      sync scheduling.
# Usage (repository root, GPU machine): OUT=$OUT bash benchmarks/tools/gpu_checks.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
PY=${PYTHON:-python3}
start_log "$OUT/gpu_checks"

timeout 300 $PYTEST -m gpu tests/engine/test_piecewise_graphs.py tests/kernels/test_prefill_split.py \
  tests/kernels/test_gluon_prefill.py \
  tests/engine/test_engine_hybrid.py tests/engine/test_engine_kv_tiers.py tests/engine/test_scheduling_latency.py \
  tests/hf/test_hf_cache.py tests/kernels/test_kernels_decode_write.py > "$R/tests.log" 2>&1
say "GPU tests: exit $? $(tail -n 1 "$R/tests.log")"

timeout 90 $PY -m pagedkv bench latency --models "gemma3-1b:1,64" --impls pagedkv --no-hf-compiled \
  --out "$R/latency" > "$R/latency.log" 2>&1
say "bench latency gemma3-1b: exit $?"
grep -E "roofline|ms" "$R/latency.log" | tail -n 8 | while read -r line; do say "  $line"; done

timeout 150 $PY benchmarks/tools/stop_strings_async.py --out "$R" > "$R/stop_strings.log" 2>&1
say "stop strings: exit $?"
grep -E "tok/s" "$R/stop_strings.log" | while read -r line; do say "  $line"; done
finish_log
