#!/usr/bin/env bash
# `pagedkv serve` with the engine in the server's process against `--engine-process`, on the same requests.
#
# Run from the repository root (GPU: `OUT=$OUT bash benchmarks/tools/serve_engine_process.sh`, carrying .whl
# and .commit, as serve_vs_engine.sh). Writes $OUT/engine_process.md and .json: the offline engine's output
# tok/s, then each server's saturated streaming throughput and TTFT/TPOT/ITL on nano-vllm's workload.
# Environment as serve_vs_engine.sh (MODEL, NUM_REQUESTS, MIN_LEN, MAX_LEN, MAX_MODEL_LEN, DEVICE, PYTHON,
# WHEELS). CPU smoke: MODEL=random:tiny-llama NUM_REQUESTS=16 MIN_LEN=8 MAX_LEN=32 MAX_MODEL_LEN=256
# DEVICE=cpu PYTHON=.venv/bin/python WHEELS=none OUT=/tmp/ep bash benchmarks/tools/serve_engine_process.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-random:qwen3-0.6b}
NUM_REQUESTS=${NUM_REQUESTS:-256}; MIN_LEN=${MIN_LEN:-100}; MAX_LEN=${MAX_LEN:-1024}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; DEVICE=${DEVICE:-}; PORT=${PORT:-8124}
PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}
W=$(mktemp -d "${TMPDIR:-/tmp}/serve_engine_process.XXXXXX")
start_log "$W"
trap 'stop_server; cp "$W"/engine_process.* "$W/summary.log" "$OUT/" 2>/dev/null' EXIT

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$WHEELS"/*.whl > "$W/wheels.log" 2>&1
  export PYTHONPATH="src:$W/site"
fi
DEVICE_FLAG=(); [ -n "$DEVICE" ] && DEVICE_FLAG=(--device "$DEVICE")
FLAGS=(--max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens 8192 --kv-cache-memory 0.3
       "${DEVICE_FLAG[@]}")
timeout 240 $PY benchmarks/tools/serve_vs_engine.py engine --out "$W" --model "$MODEL" --num-requests "$NUM_REQUESTS" \
  --min-len "$MIN_LEN" --max-len "$MAX_LEN" --single-input-len 16 --single-output-len 16 "${FLAGS[@]}" \
  > "$W/engine.log" 2>&1
say "engine: $(grep -E '^offline' "$W/engine.log" | head -2 | tr '\n' ' ')"

for mode in in-process engine-process; do
  extra=(); [ $mode = engine-process ] && extra=(--engine-process)
  $PY -m pagedkv serve "$MODEL" --host 127.0.0.1 --port "$PORT" --log-level warning "${FLAGS[@]}" "${extra[@]}" \
    > "$W/server_$mode.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 240); do
    $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  for run in warm sat; do
    file=requests_warm.json; [ $run = sat ] && file=requests.json
    num=$($PY -c "import json, sys; print(len(json.load(open(sys.argv[1]))))" "$W/$file")
    timeout 200 $PY -m pagedkv bench serve --base-url "http://127.0.0.1:$PORT" --dataset ids --dataset-path "$W/$file" \
      --num-prompts "$num" --request-rate inf --ignore-eos --disable-tqdm --out "$W/$mode-$run" > "$W/$mode-$run.log" 2>&1
    say "$mode $run: exit $? $(grep -E 'Output token throughput' "$W/$mode-$run.log" | tr -s ' ')"
  done
  grep -E "^(TTFT|TPOT|ITL) |failed" "$W/$mode-sat.log" | while read -r line; do say "  $line"; done
  stop_server
done

$PY - "$W" <<'EOF' > "$W/engine_process.md"
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
engine = json.loads((w / "engine.json").read_text())
offline = engine["offline"]["output_tokens_per_s"]
rows, summary = [], {"offline_output_tokens_per_s": offline, "provenance": engine.get("provenance")}
for mode in ("in-process", "engine-process"):
    path = w / f"{mode}-sat" / "serve.json"
    if not path.is_file():
        rows.append(f"| {mode} | (no result) | | | | |")
        continue
    m = json.loads(path.read_text())["runs"][0]["summary"]
    tps = m["output_throughput"]
    pick = lambda key: round(m[key]["p50"], 2) if m.get(key) else None
    summary[mode] = {"output_tokens_per_s": tps, "ttft_p50_ms": pick("ttft_ms"), "tpot_p50_ms": pick("tpot_ms"),
                     "itl_p50_ms": pick("itl_ms"), "failed": m["num_failed"]}
    ratio = f"{tps / offline:.2f}" if tps and offline else ""
    rows.append(f"| {mode} | {tps:,.0f} | {ratio} | {pick('ttft_ms')} | {pick('tpot_ms')} | {pick('itl_ms')} |")
(w / "engine_process.json").write_text(json.dumps(summary, indent=2))
print(f"# pagedkv serve: engine in the server's process vs its own ({engine.get('provenance', {})})\n")
print(f"Offline engine on the same requests: {offline:,.0f} output tok/s\n" if offline else "")
print("| server | output tok/s | / offline | TTFT P50 ms | TPOT P50 ms | ITL P50 ms |\n|---|---:|---:|---:|---:|---:|")
print("\n".join(rows))
EOF
cat "$W/engine_process.md"
