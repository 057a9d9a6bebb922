#!/usr/bin/env bash
# Latency under load: `pagedkv serve` (Llama-3-8B shape, random weights) with random 1,024 in / 256 out, under 5 minutes.
#
#   OUT=$OUT bash benchmarks/tools/latency_under_load.sh       # GPU machine: carry .whl (server deps) and .commit
#
# 1. idle: the offline engine, one request at a time (1,024-token prompt): its prefill (time to the first token)
#    and its decode step (P50), the baselines of the targets;
# 2. saturation: the server with every request at once (rate inf): requests/s = the saturated rate R;
# 3. load: Poisson arrivals at 25%, 50%, 75% and 90% of R (one `bench serve` with a list of rates, so it draws
#    latency against rate in serve.png): TTFT, TPOT and ITL at P50 and P99;
# 4. targets, as hit or miss: at 50% load TPOT P99 <= 1.5x the idle decode step; TTFT P99 <= 3x the idle prefill.
# Writes $OUT/latency_under_load.md, .json and .png (+ results.tgz). Benchmarks never assert.
# Environment: SERVER_FLAGS (--engine-process), MODEL (random:llama3-8b), NUM_PROMPTS (150 per rate), SAT_PROMPTS (200), MAX_NUM_BATCHED_TOKENS (2048),
# FRACTIONS ("0.25 0.5 0.75 0.9"). CPU smoke: MODEL=random:tiny-llama IN=32 OUT_LEN=8 NUM_PROMPTS=6 SAT_PROMPTS=6
#   MAX_MODEL_LEN=256 DEVICE=cpu SLOW=10 BUDGET_S=3000 PYTHON=.venv/bin/python WHEELS=none OUT=/tmp/lul bash benchmarks/tools/latency_under_load.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-random:llama3-8b}; IN=${IN:-1024}; OUT_LEN=${OUT_LEN:-256}
NUM_PROMPTS=${NUM_PROMPTS:-150}; SAT_PROMPTS=${SAT_PROMPTS:-200}; FRACTIONS=${FRACTIONS:-"0.25 0.5 0.75 0.9"}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-2048}
KV_CACHE_MEMORY=${KV_CACHE_MEMORY:-0.5}; DEVICE=${DEVICE:-}; PORT=${PORT:-8126}; BUDGET_S=${BUDGET_S:-290}
PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}; SERVER_FLAGS=${SERVER_FLAGS:---engine-process}
NAME=latency_under_load
source benchmarks/tools/serve_lib.sh
say "commit $PAGEDKV_COMMIT; $(nvidia-smi -L 2>/dev/null | head -1); $($PY --version 2>&1)"
install_wheels
DEVICE_FLAG=(); [ -n "$DEVICE" ] && DEVICE_FLAG=(--device "$DEVICE")
FLAGS=(--max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS"
       --kv-cache-memory "$KV_CACHE_MEMORY" "${DEVICE_FLAG[@]}")

# 1. idle figures from the engine itself: batch 1, a prompt of IN tokens (its TTFT is the idle prefill)
phase idle 100 $PY benchmarks/tools/serve_vs_engine.py engine --out "$W/idle" --model "$MODEL" --num-requests 2 \
  --min-len 8 --max-len 16 --single-input-len "$IN" --single-output-len 64 --skip-streaming "${FLAGS[@]}"
grep -E "^(engine up|batch 1)" "$W/idle.log" | while read -r line; do say "  $line"; done

start_server "$W/server.log" "$MODEL" "${FLAGS[@]}" $SERVER_FLAGS
BENCH=($PY -m pagedkv bench serve --base-url "http://127.0.0.1:$PORT" --dataset random --random-input-len "$IN"
       --random-output-len "$OUT_LEN" --ignore-eos --disable-tqdm)
phase warm 60 "${BENCH[@]}" --num-prompts 8 --request-rate inf --seed 1 --out "$W/warm"
# 2. saturation
phase sat 80 "${BENCH[@]}" --num-prompts "$SAT_PROMPTS" --request-rate inf --seed 2 --out "$W/sat"
RATE=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['runs'][0]['summary']['request_throughput'])" \
  "$W/sat/serve.json" 2>/dev/null || echo "")
say "saturated request rate: ${RATE:-n/a} req/s"
# 3. Poisson at fractions of it
if [ -n "$RATE" ]; then
  RATES=$($PY -c "import sys; r = float(sys.argv[1]); print(','.join(f'{r * float(f):.3f}' for f in sys.argv[2:]))" \
    "$RATE" $FRACTIONS)
  phase load 150 "${BENCH[@]}" --num-prompts "$NUM_PROMPTS" --request-rate "$RATES" --seed 3 --out "$W/load"
fi
stop_server

$PY - "$W" "$FRACTIONS" <<'EOF' > "$W/latency_under_load.md"
import json, shutil, sys
from pathlib import Path
w, fractions = Path(sys.argv[1]), [float(f) for f in sys.argv[2].split()]
def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
idle = (load(w / "idle" / "engine.json") or {}).get("batch1") or {}
decode_ms, prefill_ms = idle.get("decode_step_ms_p50"), idle.get("ttft_ms")
sat = ((load(w / "sat" / "serve.json") or {}).get("runs") or [{}])[0].get("summary") or {}
runs = (load(w / "load" / "serve.json") or {}).get("runs") or []
def fmt(v, d=1):
    return "n/a" if v is None else f"{v:,.{d}f}"
def pct(m, key, p):
    return (m.get(key) or {}).get(p)
print(f"# Latency under load ({(load(w / 'idle' / 'engine.json') or {}).get('model')}, random {idle.get('input_len')} in, "
      f"commit {((load(w / 'idle' / 'engine.json') or {}).get('provenance') or {}).get('commit')})\n")
print(f"Idle (engine, batch 1): prefill of one request {fmt(prefill_ms)} ms, decode step P50 {fmt(decode_ms, 2)} ms. "
      f"Saturated: {fmt(sat.get('request_throughput'), 2)} req/s, {fmt(sat.get('output_throughput'), 0)} output tok/s.\n")
print("| load | rate req/s | TTFT P50 / P99 ms | TPOT P50 / P99 ms | ITL P50 / P99 ms | output tok/s |\n"
      "|---|---:|---|---|---|---:|")
rows = []
for fraction, run in zip(fractions, runs):
    m = run.get("summary") or {}
    row = {"fraction": fraction, "rate": run.get("request_rate"), **{f"{k[:-3]}_{p}_ms": pct(m, k, p)
           for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for p in ("p50", "p99")},
           "output_tokens_per_s": m.get("output_throughput")}
    rows.append(row)
    print(f"| {fraction:.0%} | {fmt(row['rate'], 2)} | {fmt(row['ttft_p50_ms'])} / {fmt(row['ttft_p99_ms'])} | "
          f"{fmt(row['tpot_p50_ms'], 2)} / {fmt(row['tpot_p99_ms'], 2)} | {fmt(row['itl_p50_ms'], 2)} / "
          f"{fmt(row['itl_p99_ms'], 2)} | {fmt(row['output_tokens_per_s'], 0)} |")
targets = []
half = next((r for r in rows if abs(r["fraction"] - 0.5) < 1e-9), None)
if half and decode_ms and half["tpot_p99_ms"] is not None:
    ratio = half["tpot_p99_ms"] / decode_ms
    targets.append({"target": "TPOT P99 at 50% load <= 1.5x idle decode step", "ratio": ratio, "hit": ratio <= 1.5})
for row in rows:
    if prefill_ms and row["ttft_p99_ms"] is not None:
        ratio = row["ttft_p99_ms"] / prefill_ms
        targets.append({"target": f"TTFT P99 at {row['fraction']:.0%} load <= 3x idle prefill", "ratio": ratio,
                        "hit": ratio <= 3.0})
print("\n| target | measured | |\n|---|---:|---|")
for t in targets:
    print(f"| {t['target']} | {t['ratio']:.2f}x | {'hit' if t['hit'] else 'miss'} |")
if (w / "load" / "serve.png").is_file():
    shutil.copy(w / "load" / "serve.png", w / "latency_under_load.png")
    print("\n![latency against request rate](latency_under_load.png)")
(w / "latency_under_load.json").write_text(json.dumps({"idle": {"prefill_ms": prefill_ms, "decode_step_ms": decode_ms},
                                                       "saturated": sat, "rows": rows, "targets": targets}, indent=1))
EOF
cat "$W/latency_under_load.md"
