#!/usr/bin/env bash
# Session 4, second two-GPU call. Stage 1 (both GPUs): routing policies on two replicas, warmed up,
# on the default shared-prefix workload and on one whose prefixes overflow a replica's pool.
# Stage 2 lanes: GPU 0 the FP8 decode sweep (fewer warps, bigger tiles) and the drop-in latency
# (default vs fused); GPU 1 the fused-kernel fix (diagnosis, reference test, generate tests with
# the fused path on), then the kernel GPU tests verbosely.
set -u
source benchmarks/gpu_env.sh
R=/tmp/r4b; mkdir -p "$R"
T0=$(date +%s); say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.log"; }
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -rf"
say "stage 1: routing, 32 prompts"
timeout 130 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1; echo "rc=$?" >> "$R/routing.log"
say "stage 1: routing, 256 prompts, 16 GiB pools"
timeout 130 python3 -m pagedkv bench parallel routing --system-prompts 256 --routing-kv-gib 16 --routing-key routing_256_prompts_16gib \
  --out "$R" >> "$R/routing.log" 2>&1; echo "rc=$?" >> "$R/routing.log"
grep -E "^routing|rc=|Error" "$R/routing.log" | cut -c1-500 | tee -a "$R/summary.log"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  say "gpu0: fp8 sweep"
  PAGEDKV_FP8_CONVERT=fp32 PAGEDKV_FP8_COMPUTE=model timeout 80 python3 benchmarks/fp8_decode_sweep.py --block-n 64,128 --warps 1,2 --stages 3 > "$R/fp8_sweep.jsonl" 2> "$R/fp8_sweep.err"
  timeout 90 python3 benchmarks/fp8_decode_sweep.py --block-n 64,128,256 --warps 1,2 --stages 3 >> "$R/fp8_sweep.jsonl" 2>> "$R/fp8_sweep.err"
  tail -3 "$R/fp8_sweep.err" >> "$R/summary.log"
  python3 - "$R/fp8_sweep.jsonl" >> "$R/summary.log" <<'PY'
import json, sys
for r in (json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")):
    print(r["route"], r["batch"], r["seq_len"], r["block_n"], r["warps"], r["stages"], "fp8 %s us" % (r["fp8_us"] and round(r["fp8_us"], 1)),
          "bf16 %s" % (r["bf16_us"] and round(r["bf16_us"], 1)), "ratio %s" % (r["ratio"] and round(r["ratio"], 3)), r["error"] or "")
PY
  say "gpu0: bench hf latency"
  timeout 170 python3 -m pagedkv bench hf --only latency --out "$R" > "$R/hf_latency.log" 2>&1; echo "rc=$?" >> "$R/hf_latency.log"
  tail -25 "$R/hf_latency.log" >> "$R/summary.log"
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  say "gpu1: fused diagnosis"; timeout 100 python3 benchmarks/diag_fused.py > "$R/diag_fused.log" 2>&1
  grep '^{' "$R/diag_fused.log" | cut -c1-300 >> "$R/summary.log"; tail -2 "$R/diag_fused.log" >> "$R/summary.log"
  say "gpu1: fused tests"
  PAGEDKV_FUSED_DECODE=1 timeout 150 $PYTEST -q -m gpu tests/test_kernels_decode_write_gpu.py tests/test_gpu_models.py \
    tests/test_hf_cache_gpu.py > "$R/gpu_tests_fused.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_fused.log"
  grep -E "passed|failed|FAILED|rc=" "$R/gpu_tests_fused.log" | tail -25 >> "$R/summary.log"
  say "gpu1: kernel tests"
  timeout 170 $PYTEST -v --durations=15 -m gpu tests/test_kernels_fp8_gpu.py tests/test_decode_tiles.py tests/test_kernels_gpu.py \
    tests/test_sampler.py > "$R/gpu_tests_kernels.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_kernels.log"
  grep -E "FAILED|rc=|passed|failed" "$R/gpu_tests_kernels.log" | tail -25 >> "$R/summary.log"
}
lane0 & lane1 & wait
say "done"
tar czf "$OUT/results.tgz" -C "$R" . ; cp "$R/summary.log" "$OUT/"; tail -c 11500 "$R/summary.log"
