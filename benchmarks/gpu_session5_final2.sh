#!/usr/bin/env bash
# Session 5, one GPU (~3 minutes): the GPU tests the final check's slots cut (tiles GPU tests, the FP8 engine
# tests), then FP8 tiles at smaller tiles and other stage counts (fewer registers, more programs per SM).
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5g
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rf --tb=short"
say "tiles + FP8 engine GPU tests"
timeout 110 $PYTEST -m gpu tests/test_decode_tiles.py tests/test_kernels_fp8_gpu.py -k "tiles_gpu or engine" \
  > "$R/tests.log" 2>&1
tail -4 "$R/tests.log" >> "$R/summary.log"
say "fp8 tiles sweep: 32/64 tokens, 1/2 warps, 2-4 stages"
timeout 90 python3 benchmarks/fp8_decode_sweep.py --schedule tiles --block-n 32,64 --warps 1,2 --stages 2,3,4 \
  > "$R/fp8_tiles_small.jsonl" 2> "$R/fp8_tiles_small.err"
python3 - "$R" <<'PY' | tee -a "$R/summary.log"
import json, sys
for line in open(f"{sys.argv[1]}/fp8_tiles_small.jsonl"):
    r = json.loads(line)
    print(r["batch"], r["seq_len"], r["block_n"], r["warps"], r["stages"], r["fp8_us"] and round(r["fp8_us"], 1),
          r["bf16_us"] and round(r["bf16_us"], 1), r["ratio"] and round(r["ratio"], 3), r["error"])
PY
finish_log
