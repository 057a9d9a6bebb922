#!/usr/bin/env bash
# `--max-num-batched-tokens` against TTFT, TPOT and ITL: one `pagedkv serve` per budget, the same Poisson load.
#
#   OUT=$OUT bash benchmarks/tools/batched_tokens_sweep.sh     # GPU machine: carry .whl (server deps) and .commit
#
# Qwen3-0.6B shape (random weights), random 1,024 in / 256 out, NUM_PROMPTS requests at RATE req/s (Poisson,
# seed fixed, so every budget gets the same requests at the same times). Per budget: TTFT, TPOT and ITL at P50
# and P99 and output tok/s. A small budget spreads a prompt's prefill over more steps (TTFT grows) and keeps
# each step short (ITL stays low); a large one does the reverse. Under 5 minutes with the defaults.
# Writes $OUT/batched_tokens_sweep.md and .json (+ results.tgz). The CPU estimate is batched_tokens_sim.py.
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-random:qwen3-0.6b}; IN=${IN:-1024}; OUT_LEN=${OUT_LEN:-256}
RATE=${RATE:-40}; NUM_PROMPTS=${NUM_PROMPTS:-400}; BUDGETS=${BUDGETS:-"512 1024 2048 4096 8192"}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; KV_CACHE_MEMORY=${KV_CACHE_MEMORY:-0.3}; DEVICE=${DEVICE:-}
PORT=${PORT:-8127}; BUDGET_S=${BUDGET_S:-290}; PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}
SERVER_FLAGS=${SERVER_FLAGS:---engine-process}
NAME=batched_tokens_sweep
source benchmarks/tools/serve_lib.sh
say "commit $PAGEDKV_COMMIT; $(nvidia-smi -L 2>/dev/null | head -1); $($PY --version 2>&1)"
install_wheels
DEVICE_FLAG=(); [ -n "$DEVICE" ] && DEVICE_FLAG=(--device "$DEVICE")
for budget in $BUDGETS; do
  [ "$(left)" -lt 45 ] && { say "budget $budget: skipped, time spent"; continue; }
  start_server "$W/server_$budget.log" "$MODEL" --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 \
    --max-num-batched-tokens "$budget" --kv-cache-memory "$KV_CACHE_MEMORY" "${DEVICE_FLAG[@]}" $SERVER_FLAGS
  BENCH=($PY -m pagedkv bench serve --base-url "http://127.0.0.1:$PORT" --dataset random --random-input-len "$IN"
         --random-output-len "$OUT_LEN" --ignore-eos --disable-tqdm)
  phase "warm_$budget" 30 "${BENCH[@]}" --num-prompts 8 --request-rate inf --seed 1 --out "$W/warm_$budget"
  phase "b$budget" 60 "${BENCH[@]}" --num-prompts "$NUM_PROMPTS" --request-rate "$RATE" --seed 2 --out "$W/b$budget"
  stop_server
done
$PY - "$W" "$BUDGETS" "$RATE" <<'PYEOF' > "$W/$NAME.md"
import json, sys
from pathlib import Path
w, budgets, rate = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3]
rows = []
fmt = lambda v, d=1: "n/a" if v is None else f"{v:,.{d}f}"
print(f"# --max-num-batched-tokens: random 1,024 in / 256 out at {rate} req/s (Poisson)\n")
print("| budget | TTFT P50 / P99 ms | TPOT P50 / P99 ms | ITL P50 / P99 ms | output tok/s | failed |\n|---:|---|---|---|---:|---:|")
for budget in budgets:
    try:
        m = json.loads((w / f"b{budget}" / "serve.json").read_text())["runs"][0]["summary"]
    except (OSError, ValueError, KeyError, IndexError):
        print(f"| {budget} | (no result) | | | | |")
        continue
    p = lambda key, q: (m.get(key) or {}).get(q)
    row = {"budget": int(budget), **{f"{k[:-3]}_{q}_ms": p(k, q) for k in ("ttft_ms", "tpot_ms", "itl_ms")
                                     for q in ("p50", "p99")},
           "output_tokens_per_s": m.get("output_throughput"), "failed": m.get("num_failed")}
    rows.append(row)
    print(f"| {budget} | {fmt(row['ttft_p50_ms'])} / {fmt(row['ttft_p99_ms'])} | {fmt(row['tpot_p50_ms'], 2)} / "
          f"{fmt(row['tpot_p99_ms'], 2)} | {fmt(row['itl_p50_ms'], 2)} / {fmt(row['itl_p99_ms'], 2)} | "
          f"{fmt(row['output_tokens_per_s'], 0)} | {row['failed']} |")
(w / "batched_tokens_sweep.json").write_text(json.dumps({"rate": float(rate), "rows": rows}, indent=1))
PYEOF
cat "$W/$NAME.md"
