#!/usr/bin/env bash
# Session 5, one GPU (~7 minutes): FP8 tiles read as int32 words (no byte-wise shared loads): the FP8 GPU
# tests on the new default, the split and tiles sweeps, then the KV-bound engine, FP8 against bf16.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5b
say "fp8 GPU tests"
timeout 110 $PYTEST -m gpu tests/test_kernels_fp8_gpu.py > "$R/gpu_tests_fp8.log" 2>&1
tail -4 "$R/gpu_tests_fp8.log" >> "$R/summary.log"
say "fp8 split sweep, words"
timeout 75 python3 benchmarks/fp8_decode_sweep.py --block-n 64,128 --warps 2,4,8 --stages 3 \
  > "$R/fp8_words_split.jsonl" 2> "$R/fp8_words_split.err"
say "fp8 tiles sweep, words"
timeout 55 python3 benchmarks/fp8_decode_sweep.py --schedule tiles --block-n 64,128 --warps 2,4 --stages 3 \
  > "$R/fp8_words_tiles.jsonl" 2> "$R/fp8_words_tiles.err"
python3 - "$R" <<'PY' | tee -a "$R/summary.log"
import json, sys
for name in ("fp8_words_split", "fp8_words_tiles"):
    for line in open(f"{sys.argv[1]}/{name}.jsonl"):
        r = json.loads(line)
        print(name, r["batch"], r["seq_len"], r["block_n"], r["warps"], r["stages"], r["fp8_us"] and round(r["fp8_us"], 1),
              r["bf16_us"] and round(r["bf16_us"], 1), r["ratio"] and round(r["ratio"], 3), r["fp8_tbps"] and round(r["fp8_tbps"], 2), r["error"])
PY
tail -3 "$R/fp8_words_split.err" "$R/fp8_words_tiles.err" >> "$R/summary.log"
say "kv-bound engine"
mkdir -p "$R/kv"
timeout 220 python3 -m pagedkv bench engine --preset kv-bound --out "$R/kv" > "$R/kv.log" 2>&1
grep -E "^\||Target|Error" "$R/kv.log" | cut -c1-200 >> "$R/summary.log"
finish_log
