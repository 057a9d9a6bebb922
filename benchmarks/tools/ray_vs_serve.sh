#!/usr/bin/env bash
# One replica through the Ray Serve app (`pagedkv serve --ray`) against direct `pagedkv serve`, same requests.
#
# Run from the repository root on one GPU: `OUT=$OUT bash benchmarks/tools/ray_vs_serve.sh`, with ray and the
# server's dependencies importable from /tmp/site (SITE=...). For each server, in turn: start it, wait for
# /health, then with `pagedkv bench serve` (same seed, so the same requests):
#   warm   64 requests at full rate (JIT, allocator, Ray's first calls)
#   sat    NUM_PROMPTS random requests (INPUT_LEN in, OUTPUT_LEN out) at full rate: output tok/s
#   low    LOW_PROMPTS requests one at a time (--max-concurrency 1): TTFT P50 at low load
# Writes $OUT/ray_vs_serve.md and .json: both servers' figures, the saturated throughput ratio (target >= 0.95x)
# and the TTFT P50 that Ray adds at low load (target <= 3 ms). Expected: about 6 minutes on an H200.
# CPU smoke: MODEL=random:tiny-llama VOCAB=512 NUM_PROMPTS=16 INPUT_LEN=16 OUTPUT_LEN=8 LOW_PROMPTS=4 MAX_MODEL_LEN=256
#   DEVICE=cpu SITE= PYTHON=.venv/bin/python OUT=/tmp/rvs bash benchmarks/tools/ray_vs_serve.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
SITE=${SITE-/tmp/site}
[ -n "$SITE" ] && export PYTHONPATH="src:$SITE"
export RAY_USAGE_STATS_ENABLED=0
MODEL=${MODEL:-random:qwen3-0.6b}
NUM_PROMPTS=${NUM_PROMPTS:-1024}; INPUT_LEN=${INPUT_LEN:-512}; OUTPUT_LEN=${OUTPUT_LEN:-256}
LOW_PROMPTS=${LOW_PROMPTS:-64}; MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; DEVICE=${DEVICE:-}; PORT=${PORT:-8125}
VOCAB=${VOCAB:-}  # token ids drawn below this (a tiny model's vocabulary is small); default: bench serve's
PY=${PYTHON:-python3}
W=$(mktemp -d "${TMPDIR:-/tmp}/ray_vs_serve.XXXXXX")
start_log "$W"
trap 'stop_server 45; cp "$W"/ray_vs_serve.* "$W/summary.log" "$OUT/" 2>/dev/null' EXIT
say "ray: $($PY -c 'import ray; print(ray.__version__)' 2>&1 | tail -1)"

DEVICE_FLAG=(); [ -n "$DEVICE" ] && DEVICE_FLAG=(--device "$DEVICE")
FLAGS=(--max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens 8192 --kv-cache-memory 0.5
       "${DEVICE_FLAG[@]}")
BENCH=(--dataset random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --ignore-eos
       --seed 0 --disable-tqdm)
[ -n "$VOCAB" ] && BENCH+=(--vocab-size "$VOCAB")

for mode in serve ray; do
  extra=(); [ $mode = ray ] && extra=(--ray --routing prefix)
  $PY -m pagedkv serve "$MODEL" --host 127.0.0.1 --port "$PORT" --log-level warning "${FLAGS[@]}" "${extra[@]}" \
    > "$W/server_$mode.log" 2>&1 &
  SERVER_PID=$!
  started=$(date +%s)
  for _ in $(seq 300); do
    $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  say "$mode: up after $(( $(date +%s) - started )) s"
  URL="http://127.0.0.1:$PORT"
  timeout 200 $PY -m pagedkv bench serve --base-url "$URL" "${BENCH[@]}" --num-prompts 64 --request-rate inf \
    --out "$W/$mode-warm" > "$W/$mode-warm.log" 2>&1
  say "$mode warm: exit $?"
  timeout 300 $PY -m pagedkv bench serve --base-url "$URL" "${BENCH[@]}" --num-prompts "$NUM_PROMPTS" \
    --request-rate inf --out "$W/$mode-sat" > "$W/$mode-sat.log" 2>&1
  say "$mode sat: exit $? $(grep -E 'Output token throughput' "$W/$mode-sat.log" | tr -s ' ')"
  timeout 300 $PY -m pagedkv bench serve --base-url "$URL" "${BENCH[@]}" --num-prompts "$LOW_PROMPTS" \
    --request-rate inf --max-concurrency 1 --out "$W/$mode-low" > "$W/$mode-low.log" 2>&1
  say "$mode low: exit $? $(grep -E '^TTFT ' "$W/$mode-low.log" | tr -s ' ')"
  stop_server 45
done

$PY - "$W" <<'EOF' > "$W/ray_vs_serve.md"
import json, os, sys
from pathlib import Path
w = Path(sys.argv[1])

def summary(name):
    path = w / name / "serve.json"
    return json.loads(path.read_text())["runs"][0]["summary"] if path.is_file() else None

def p50(m, key):
    return round(m[key]["p50"], 2) if m and m.get(key) else None

result = {"commit": os.environ.get("PAGEDKV_COMMIT")}
rows = []
for mode in ("serve", "ray"):
    sat, low = summary(f"{mode}-sat"), summary(f"{mode}-low")
    result[mode] = {"sat_output_tokens_per_s": sat and sat["output_throughput"], "sat_failed": sat and sat["num_failed"],
                    "sat_ttft_p50_ms": p50(sat, "ttft_ms"), "sat_tpot_p50_ms": p50(sat, "tpot_ms"),
                    "low_ttft_p50_ms": p50(low, "ttft_ms"), "low_tpot_p50_ms": p50(low, "tpot_ms"),
                    "low_failed": low and low["num_failed"]}
    r = result[mode]
    tps = f"{r['sat_output_tokens_per_s']:,.0f}" if r["sat_output_tokens_per_s"] else "(no result)"
    rows.append(f"| {mode} | {tps} | {r['sat_ttft_p50_ms']} | {r['sat_tpot_p50_ms']} | {r['low_ttft_p50_ms']} "
                f"| {r['low_tpot_p50_ms']} | {r['sat_failed']} / {r['low_failed']} |")
direct, ray = result["serve"], result["ray"]
if direct["sat_output_tokens_per_s"] and ray["sat_output_tokens_per_s"]:
    result["throughput_ratio"] = round(ray["sat_output_tokens_per_s"] / direct["sat_output_tokens_per_s"], 3)
if direct["low_ttft_p50_ms"] is not None and ray["low_ttft_p50_ms"] is not None:
    result["ttft_p50_added_ms"] = round(ray["low_ttft_p50_ms"] - direct["low_ttft_p50_ms"], 2)
(w / "ray_vs_serve.json").write_text(json.dumps(result, indent=2))
print(f"# One replica through Ray Serve vs direct pagedkv serve (commit {result['commit']})\n")
print("| server | saturated output tok/s | sat TTFT P50 ms | sat TPOT P50 ms | low-load TTFT P50 ms "
      "| low-load TPOT P50 ms | failed (sat / low) |\n|---|---:|---:|---:|---:|---:|---:|")
print("\n".join(rows))
print(f"\nthroughput ratio ray / serve: {result.get('throughput_ratio')} (target >= 0.95)")
print(f"TTFT P50 added at low load: {result.get('ttft_p50_added_ms')} ms (target <= 3)")
EOF
cat "$W/ray_vs_serve.md"
