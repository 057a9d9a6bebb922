#!/usr/bin/env bash
# Session 5, one GPU (~3 minutes): decode with keys as the mma's rows (half the mma work at GQA 4), bf16 and FP8.
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5k
say "keys-as-rows sweep"
timeout 200 python3 benchmarks/keys_as_rows_sweep.py > "$R/kar_sweep.jsonl" 2> "$R/kar_sweep.err"
python3 - "$R" <<'PY' | tee -a "$R/summary.log"
import json, sys
for line in open(f"{sys.argv[1]}/kar_sweep.jsonl"):
    r = json.loads(line)
    print(r["kv"], r["batch"], r["seq_len"], r["config"], r["us"] and round(r["us"], 1), r["tbps"] and round(r["tbps"], 2),
          "%.1e" % r["err"] if "err" in r else "", r["error"] or "")
PY
tail -3 "$R/kar_sweep.err" >> "$R/summary.log"
finish_log
