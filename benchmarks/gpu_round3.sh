#!/usr/bin/env bash
# The third session's last two-GPU call (nvidia-h200-x2). Stage 1 uses both GPUs: Llama-3-8B fp32
# greedy at TP=2 vs TP=1, and prefix-aware vs round-robin routing over two replicas. Stage 2 runs
# two lanes at once, one per GPU: GPU 0 the drop-in cache latency, the FP8 engine (KV-bound) and
# the cache GPU tests; GPU 1 the decode-kernel sweep, the FP8 kernel cases and the kernel GPU tests.
# Every command has its own timeout; everything lands in $OUT/results.tgz plus a summary log.
set -u
source benchmarks/gpu_env.sh
R=/tmp/r3; mkdir -p "$R"
T0=$(date +%s); say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.log"; }
PYTEST="python3 -m pytest -q -o addopts= -p no:cacheprovider"
say "stage 1: tp-greedy"; timeout 90 python3 -m pagedkv bench parallel tp-greedy --out "$R" > "$R/parallel.log" 2>&1
say "stage 1: routing"; timeout 100 python3 -m pagedkv bench parallel routing --out "$R" >> "$R/parallel.log" 2>&1
grep -E "^(tp_greedy|routing)" "$R/parallel.log" | cut -c1-600 | tee -a "$R/summary.log"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  say "gpu0: bench hf latency"; timeout 150 python3 -m pagedkv bench hf --only latency --out "$R" > "$R/hf_latency.log" 2>&1
  tail -30 "$R/hf_latency.log" >> "$R/summary.log"
  say "gpu0: kv-bound engine"; timeout 110 python3 -m pagedkv bench engine --preset kv-bound --out "$R" > "$R/engine_kv.log" 2>&1
  tail -12 "$R/engine_kv.log" >> "$R/summary.log"
  say "gpu0: cache tests"; timeout 50 $PYTEST -m gpu tests/test_hf_cache_gpu.py tests/test_kernels_decode_write_gpu.py \
      tests/test_kernel_launch.py > "$R/gpu_tests_hf.log" 2>&1; tail -3 "$R/gpu_tests_hf.log" >> "$R/summary.log"
  say "gpu0: model tests"; timeout 60 $PYTEST -m gpu tests/test_gpu_models.py > "$R/gpu_tests_models.log" 2>&1
  tail -3 "$R/gpu_tests_models.log" >> "$R/summary.log"
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  say "gpu1: decode sweep"; timeout 190 python3 benchmarks/decode_sweep.py --out "$R" --budget-s 160 > "$R/decode_sweep.log" 2>&1
  tail -40 "$R/decode_sweep.log" >> "$R/summary.log"
  say "gpu1: fp8 kernel"; timeout 80 python3 -m pagedkv bench kernel --kv-dtype fp8_e4m3 --fp8-only --out "$R" > "$R/kernel_fp8.log" 2>&1
  tail -15 "$R/kernel_fp8.log" >> "$R/summary.log"
  say "gpu1: kernel tests"; timeout 90 $PYTEST -m gpu tests/test_kernels_gpu.py tests/test_kernels_fp8_gpu.py \
      tests/test_decode_tiles.py tests/test_engine_fp8.py > "$R/gpu_tests_kernels.log" 2>&1
  tail -3 "$R/gpu_tests_kernels.log" >> "$R/summary.log"
}
lane0 & lane1 & wait
say "done"
tar czf "$OUT/results.tgz" -C "$R" . ; cp "$R/summary.log" "$OUT/"; tail -c 11000 "$R/summary.log"
