#!/usr/bin/env bash
# Session 4, first two-GPU call (nvidia-h200-x2). Stage 1 uses both GPUs: prefix-aware vs
# round-robin routing over two replicas (issue 11's last unmeasured item). Stage 2 runs two lanes:
# GPU 0 sweeps the FP8 decode conversion routes (issue 13), GPU 1 runs the GPU test files and the
# fused-decode diagnosis (issue 15). Every command has its own timeout; results land in
# $OUT/results.tgz plus a summary log.
set -u
source benchmarks/gpu_env.sh
R=/tmp/r4a; mkdir -p "$R"
T0=$(date +%s); say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.log"; }
PYTEST="python3 -m pytest -q -o addopts= -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$R/summary.log"
say "stage 1: routing"; timeout 200 python3 -m pagedkv bench parallel routing --out "$R" > "$R/routing.log" 2>&1
echo "rc=$?" >> "$R/routing.log"; grep -E "^routing|rc=" "$R/routing.log" | cut -c1-900 | tee -a "$R/summary.log"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  say "gpu0: fp8 sweep, 353542d route"
  PAGEDKV_FP8_CONVERT=fp32 PAGEDKV_FP8_COMPUTE=model timeout 70 python3 benchmarks/fp8_decode_sweep.py --quick > "$R/fp8_sweep.jsonl" 2> "$R/fp8_sweep.err"
  say "gpu0: fp8 sweep, direct bf16"
  PAGEDKV_FP8_COMPUTE=model timeout 70 python3 benchmarks/fp8_decode_sweep.py --quick >> "$R/fp8_sweep.jsonl" 2>> "$R/fp8_sweep.err"
  say "gpu0: fp8 sweep, f16 compute"
  timeout 200 python3 benchmarks/fp8_decode_sweep.py >> "$R/fp8_sweep.jsonl" 2>> "$R/fp8_sweep.err"
  tail -5 "$R/fp8_sweep.err" >> "$R/summary.log"
  python3 - "$R/fp8_sweep.jsonl" >> "$R/summary.log" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    print(r["route"], r["batch"], r["seq_len"], r["block_n"], r["warps"], r["stages"],
          "fp8 %s us" % (r["fp8_us"] and round(r["fp8_us"], 1)), "bf16 %s us" % (r["bf16_us"] and round(r["bf16_us"], 1)),
          "ratio %s" % (r["ratio"] and round(r["ratio"], 3)), "TB/s %s" % (r["fp8_tbps"] and round(r["fp8_tbps"], 2)), r["error"] or "")
PY
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  say "gpu1: fused diagnosis"; timeout 150 python3 benchmarks/diag_fused.py > "$R/diag_fused.log" 2>&1
  grep '^{' "$R/diag_fused.log" | cut -c1-400 >> "$R/summary.log"; tail -3 "$R/diag_fused.log" >> "$R/summary.log"
  say "gpu1: gpu tests"
  timeout 240 $PYTEST -m gpu tests/test_kernels_gpu.py tests/test_decode_tiles.py tests/test_kernels_fp8_gpu.py \
      tests/test_gpu_models.py tests/test_hf_cache_gpu.py tests/test_kernels_decode_write_gpu.py tests/test_sampler.py \
      > "$R/gpu_tests.log" 2>&1
  echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "passed|failed|FAILED|rc=" "$R/gpu_tests.log" | tail -20 >> "$R/summary.log"
}
lane0 & lane1 & wait
say "done"
tar czf "$OUT/results.tgz" -C "$R" . ; cp "$R/summary.log" "$OUT/"; tail -c 11000 "$R/summary.log"
