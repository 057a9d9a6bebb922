#!/usr/bin/env bash
# Session 4, short one-GPU call: the two GPU tests rewritten after the last call (teacher-forced
# fused-vs-unfused logits; the FP8 rotary write bounded by one FP8 step), and the Llama-3.2-1B
# drop-in latency again with more samples (its batch-32 P99 was 1.56x in a 2-repeat run).
set -u
source benchmarks/gpu_env.sh
timeout 120 python3 -m pytest -o addopts= -p no:cacheprovider -q -rf --tb=short -m gpu \
  "tests/test_kernels_decode_write_gpu.py::test_generate_decode_steps_replay_bound_launches" \
  "tests/test_kernels_fp8_gpu.py::test_fused_rotary_write_in_bf16_stores_what_write_kv_stores" > "$OUT/gpu_tests_fixed.log" 2>&1
echo "rc=$?" >> "$OUT/gpu_tests_fixed.log"; tail -8 "$OUT/gpu_tests_fixed.log"
mkdir -p "$OUT/llama"
timeout 150 python3 -m pagedkv bench hf --only latency --latency-models llama3.2-1b --repeats 4 --out "$OUT/llama" > "$OUT/hf_latency_llama.log" 2>&1
echo "rc=$?" >> "$OUT/hf_latency_llama.log"; grep -E "^\||rc=" "$OUT/hf_latency_llama.log" | cut -c1-260
