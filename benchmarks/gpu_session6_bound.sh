#!/usr/bin/env bash
# Session 6, one GPU (~9 minutes): every engine Triton kernel launched bound (fused ops, decode, merge, prefill,
# tiles, write_kv). Eager steps A/B (Triton's launch path against bound), then the GPU tests that run these
# kernels: engine and models (fp32 equality with HF, graphs and eager), kernels, FP8 kernels.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r6bound
say "eager A/B"; timeout 150 python3 benchmarks/eager_launch_ab.py "$R/eager_launch_ab.json" > "$R/ab.log" 2>&1
grep -E "^\{|Error" "$R/ab.log" | cut -c1-500 | tee -a "$R/summary.log"
say "engine/model GPU tests"; timeout 130 $PYTEST -m gpu tests/test_gpu_models.py tests/test_hf_cache_gpu.py tests/test_sampler.py > "$R/models_tests.log" 2>&1
tail -3 "$R/models_tests.log" >> "$R/summary.log"
say "kernel GPU tests"; timeout 150 $PYTEST -m gpu tests/test_kernels_gpu.py > "$R/kernel_tests.log" 2>&1
tail -3 "$R/kernel_tests.log" >> "$R/summary.log"
left=$(( 540 - ($(date +%s) - T0) ))
say "FP8 kernel GPU tests (${left} s left)"; timeout $left $PYTEST -m gpu tests/test_kernels_fp8_gpu.py > "$R/fp8_tests.log" 2>&1
tail -3 "$R/fp8_tests.log" >> "$R/summary.log"
finish_log
