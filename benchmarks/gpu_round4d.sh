#!/usr/bin/env bash
# Session 4, one-GPU call (the two-GPU machine was not lent). Phase A: the GPU test files, two
# pytest processes side by side (correctness only). Phase B, alone on the GPU: the drop-in latency
# with the fused path as the default, the FP8 kernel figures with the FP8 launch defaults, and the
# KV-bound FP8 engine.
set -u
source benchmarks/gpu_env.sh
R=/tmp/r4d; mkdir -p "$R"
T0=$(date +%s); say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.log"; }
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -rf --tb=short"
say "phase A: tests"
( timeout 190 $PYTEST -q -m gpu tests/test_kernels_decode_write_gpu.py tests/test_kernels_fp8_gpu.py tests/test_hf_cache_gpu.py \
    tests/test_gpu_models.py > "$R/gpu_tests_fused_fp8_models.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_fused_fp8_models.log" ) &
( timeout 190 $PYTEST -v --durations=12 -m gpu tests/test_kernels_gpu.py tests/test_decode_tiles.py tests/test_sampler.py \
    > "$R/gpu_tests_kernels.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_kernels.log" ) &
wait
grep -E "passed|failed|FAILED|rc=|^E " "$R/gpu_tests_fused_fp8_models.log" | tail -20 | cut -c1-300 >> "$R/summary.log"
grep -E "FAILED|rc=|passed|failed" "$R/gpu_tests_kernels.log" | tail -12 >> "$R/summary.log"
say "phase B: bench hf latency"
timeout 170 python3 -m pagedkv bench hf --only latency --repeats 2 --no-diagnose --out "$R" > "$R/hf_latency.log" 2>&1
echo "rc=$?" >> "$R/hf_latency.log"; grep -E "^\||rc=" "$R/hf_latency.log" | cut -c1-220 | tail -16 >> "$R/summary.log"
say "phase B: fp8 kernel"
timeout 70 python3 -m pagedkv bench kernel --kv-dtype fp8_e4m3 --fp8-only --out "$R" > "$R/kernel_fp8.log" 2>&1
echo "rc=$?" >> "$R/kernel_fp8.log"; tail -14 "$R/kernel_fp8.log" | cut -c1-250 >> "$R/summary.log"
say "phase B: kv-bound engine"
timeout 110 python3 -m pagedkv bench engine --preset kv-bound --out "$R" > "$R/engine_kv.log" 2>&1
echo "rc=$?" >> "$R/engine_kv.log"; tail -12 "$R/engine_kv.log" | cut -c1-250 >> "$R/summary.log"
say "done"
tar czf "$OUT/results.tgz" -C "$R" . ; cp "$R/summary.log" "$OUT/"; tail -c 11500 "$R/summary.log"
