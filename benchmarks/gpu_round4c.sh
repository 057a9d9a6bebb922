#!/usr/bin/env bash
# Session 4, last two-GPU call. Stage 1 (both GPUs): routing policies, instrumented (submit time,
# per-replica busy time and last finish), on the default workload and on 256 prefixes that overflow
# 16 GiB pools. Stage 2 lanes: GPU 0 the drop-in latency with the fused path as the default, the FP8
# kernel figures with the FP8 launch defaults, the KV-bound FP8 engine; GPU 1 the GPU test files.
set -u
source benchmarks/gpu_env.sh
R=/tmp/r4c; mkdir -p "$R"
T0=$(date +%s); say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.log"; }
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -rf --tb=short"
say "stage 1: routing, 32 prompts"
timeout 120 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1; echo "rc=$?" >> "$R/routing.log"
say "stage 1: routing, 256 prompts, 16 GiB pools"
timeout 125 python3 -m pagedkv bench parallel routing --system-prompts 256 --routing-kv-gib 16 \
  --routing-key routing_256_prompts_16gib --out "$R" >> "$R/routing.log" 2>&1; echo "rc=$?" >> "$R/routing.log"
grep -E "^routing [a-z_]+:|rc=|Error" "$R/routing.log" | cut -c1-700 | tee -a "$R/summary.log"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  say "gpu0: bench hf latency"
  timeout 170 python3 -m pagedkv bench hf --only latency --repeats 2 --no-diagnose --out "$R" > "$R/hf_latency.log" 2>&1
  echo "rc=$?" >> "$R/hf_latency.log"; grep -E "\| (gpt2|llama|GPT|Llama)|rc=" "$R/hf_latency.log" | cut -c1-200 | tail -14 >> "$R/summary.log"
  say "gpu0: fp8 kernel"
  timeout 70 python3 -m pagedkv bench kernel --kv-dtype fp8_e4m3 --fp8-only --out "$R" > "$R/kernel_fp8.log" 2>&1
  echo "rc=$?" >> "$R/kernel_fp8.log"; tail -14 "$R/kernel_fp8.log" | cut -c1-250 >> "$R/summary.log"
  say "gpu0: kv-bound engine"
  timeout 110 python3 -m pagedkv bench engine --preset kv-bound --out "$R" > "$R/engine_kv.log" 2>&1
  echo "rc=$?" >> "$R/engine_kv.log"; tail -12 "$R/engine_kv.log" | cut -c1-250 >> "$R/summary.log"
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  say "gpu1: fused + fp8 tests"
  timeout 110 $PYTEST -q -m gpu tests/test_kernels_decode_write_gpu.py tests/test_kernels_fp8_gpu.py tests/test_hf_cache_gpu.py \
    > "$R/gpu_tests_fused_fp8.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_fused_fp8.log"
  grep -E "passed|failed|FAILED|rc=|^E " "$R/gpu_tests_fused_fp8.log" | tail -20 | cut -c1-300 >> "$R/summary.log"
  say "gpu1: model tests"
  timeout 60 $PYTEST -q -m gpu tests/test_gpu_models.py > "$R/gpu_tests_models.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_models.log"
  grep -E "passed|failed|FAILED|rc=" "$R/gpu_tests_models.log" | tail -8 >> "$R/summary.log"
  say "gpu1: kernel tests"
  timeout 200 $PYTEST -v --durations=12 -m gpu tests/test_kernels_gpu.py tests/test_decode_tiles.py tests/test_sampler.py \
    > "$R/gpu_tests_kernels.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_kernels.log"
  grep -E "FAILED|rc=|passed|failed" "$R/gpu_tests_kernels.log" | tail -12 >> "$R/summary.log"
}
lane0 & lane1 & wait
say "done"
tar czf "$OUT/results.tgz" -C "$R" . ; cp "$R/summary.log" "$OUT/"; tail -c 11500 "$R/summary.log"
