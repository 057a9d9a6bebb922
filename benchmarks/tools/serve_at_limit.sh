#!/usr/bin/env bash
# `pagedkv serve` (streaming) against the offline engine on the same requests, in one run, under 5 minutes.
#
#   OUT=$OUT bash benchmarks/tools/serve_at_limit.sh        # GPU machine: carry .whl (server deps) and .commit
#
# Phases (each under `timeout`, the whole under BUDGET_S):
#   1. overhead: the server path alone over an engine stand-in (benchmarks/tools/server_overhead.py; CPU only):
#      256 streams at 256 rows per 10 ms, both server modes, event-loop CPU per token;
#   2. engine: the offline engine (serve_vs_engine.py engine) on nano-vllm's workload (256 requests, prompts
#      and outputs 100-1024 token ids, ignore_eos) and on random 1,024 in / 256 out (256 requests), plus the
#      batch-1 decode step (128-token prompt, 256 new tokens); it writes the request files;
#   3. per server mode (engine-process, the default, and in-process): `pagedkv serve` + `pagedkv bench serve`
#      on the very same request files, rate inf, SSE streaming; then one stream (max concurrency 1);
#   4. hf: HF transformers' own paths on the same token ids where they exist (hf_serve_peer.py).
# Writes $OUT/serve_at_limit.md and .json (+ results.tgz with every log). Benchmarks never assert.
# CPU smoke: MODEL=random:tiny-llama NUM_REQUESTS=8 MIN_LEN=8 MAX_LEN=32 RANDOM_IN=32 RANDOM_OUT=8 RANDOM_NUM=8 \
#   SINGLE_IN=16 SINGLE_OUT=16 OVERHEAD=0 MAX_MODEL_LEN=256 DEVICE=cpu SLOW=10 BUDGET_S=3000 PYTHON=.venv/bin/python WHEELS=none OUT=/tmp/sal bash benchmarks/tools/serve_at_limit.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-random:qwen3-0.6b}
NUM_REQUESTS=${NUM_REQUESTS:-256}; MIN_LEN=${MIN_LEN:-100}; MAX_LEN=${MAX_LEN:-1024}
RANDOM_IN=${RANDOM_IN:-1024}; RANDOM_OUT=${RANDOM_OUT:-256}; RANDOM_NUM=${RANDOM_NUM:-256}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-8192}
KV_CACHE_MEMORY=${KV_CACHE_MEMORY:-0.3}; DEVICE=${DEVICE:-}; PORT=${PORT:-8125}; BUDGET_S=${BUDGET_S:-290}
MODES=${MODES:-"engine-process in-process"}; HF=${HF:-1}; OVERHEAD=${OVERHEAD:-1}; SINGLE_IN=${SINGLE_IN:-128}; SINGLE_OUT=${SINGLE_OUT:-256}
PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}
NAME=serve_at_limit
source benchmarks/tools/serve_lib.sh
say "commit $PAGEDKV_COMMIT; $(nvidia-smi -L 2>/dev/null | head -1); $($PY --version 2>&1)"
install_wheels
$PY -c "import uvicorn, fastapi; from importlib.util import find_spec as f
print('uvicorn', uvicorn.__version__, 'fastapi', fastapi.__version__, 'uvloop', bool(f('uvloop')), 'httptools', bool(f('httptools')))" \
  > "$W/imports.log" 2>&1; say "imports: $(tail -1 "$W/imports.log")"

[ "$OVERHEAD" = 1 ] && phase overhead 45 $PY benchmarks/tools/server_overhead.py run --out "$W/overhead" --num-streams 256 --num-tokens 128 \
  --step-ms 10 --busy-ms 2 --uvicorn auto --port $((PORT + 1))
[ -f "$W/overhead.log" ] && grep -E "^(in-process|engine-process):" "$W/overhead.log" | while read -r line; do say "  overhead $line"; done

DEVICE_FLAG=(); [ -n "$DEVICE" ] && DEVICE_FLAG=(--device "$DEVICE")
FLAGS=(--max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS"
       --kv-cache-memory "$KV_CACHE_MEMORY" "${DEVICE_FLAG[@]}")
phase engine 90 $PY benchmarks/tools/serve_vs_engine.py engine --out "$W" --model "$MODEL" \
  --num-requests "$NUM_REQUESTS" --min-len "$MIN_LEN" --max-len "$MAX_LEN" --single-input-len "$SINGLE_IN" \
  --single-output-len "$SINGLE_OUT" --random-num-requests "$RANDOM_NUM" --random-input-len "$RANDOM_IN" \
  --random-output-len "$RANDOM_OUT" --skip-streaming "${FLAGS[@]}"
grep -E "^(engine up|offline|batch 1)" "$W/engine.log" | while read -r line; do say "  $line"; done
[ -f "$W/requests.json" ] || { say "no request files: the engine phase failed"; tail -20 "$W/engine.log"; exit 1; }

bench() {  # bench NAME FILE [extra bench serve flags...]
  local name=$1 file=$2; shift 2
  local num; num=$($PY -c "import json, sys; print(len(json.load(open(sys.argv[1]))))" "$W/$file")
  phase "$name" 60 $PY -m pagedkv bench serve --base-url "http://127.0.0.1:$PORT" --dataset ids \
    --dataset-path "$W/$file" --num-prompts "$num" --request-rate inf --ignore-eos --disable-tqdm --out "$W/$name" "$@"
  say "  $name: $(grep -E 'Output token throughput' "$W/$name.log" | tr -s ' ')"
}
for mode in $MODES; do
  [ "$(left)" -lt 60 ] && { say "$mode: skipped, budget spent"; continue; }
  start_server "$W/server_$mode.log" "$MODEL" "${FLAGS[@]}" "--$mode"
  bench "$mode-warm" requests_warm.json
  bench "$mode-nano" requests.json
  bench "$mode-random" requests_random.json
  bench "$mode-single" requests_single.json --max-concurrency 1
  stop_server
done

[ "$HF" = 1 ] && phase hf 60 $PY benchmarks/tools/hf_serve_peer.py --out "$W/hf" --model "$MODEL" \
  --requests "$W/requests_random.json" --num-requests 64 "${DEVICE_FLAG[@]}"
[ -f "$W/hf.log" ] && tail -3 "$W/hf.log" | while read -r line; do say "  hf: $line"; done

$PY - "$W" "$MODES" <<'EOF' > "$W/serve_at_limit.md"
import json, sys
from pathlib import Path
w, modes = Path(sys.argv[1]), sys.argv[2].split()
def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
engine = load(w / "engine.json") or {}
offline = {"nano": (engine.get("offline") or {}).get("output_tokens_per_s"),
           "random": (engine.get("offline_random") or {}).get("output_tokens_per_s")}
step = (engine.get("batch1") or {}).get("decode_step_ms_p50")
summary = {"provenance": engine.get("provenance"), "offline_output_tokens_per_s": offline,
           "engine_batch1_step_ms": step, "servers": {}, "overhead": load(w / "overhead" / "server_overhead.json"),
           "hf": load(w / "hf" / "hf_serve_peer.json")}
def fmt(v, d=1):
    return "n/a" if v is None else (f"{v:,.{d}f}" if isinstance(v, float) else str(v))
print(f"# pagedkv serve (streaming) against the offline engine, same requests ({engine.get('model')}, "
      f"{(engine.get('provenance') or {}).get('device')}, commit {(engine.get('provenance') or {}).get('commit')})\n")
print("| server | workload | output tok/s | / offline (target >= 0.9) | TTFT P50/P99 ms | TPOT P50/P99 ms | "
      "ITL P50/P99 ms | failed |\n|---|---|---:|---:|---|---|---|---:|")
for workload in ("nano", "random"):
    print(f"| offline engine | {workload} | {fmt(offline[workload], 0)} | | | | | |")
for mode in modes:
    summary["servers"][mode] = {}
    for workload in ("nano", "random", "single"):
        run = load(w / f"{mode}-{workload}" / "serve.json")
        m = ((run or {}).get("runs") or [{}])[0].get("summary") if run else None
        if not m:
            print(f"| {mode} | {workload} | (no result) | | | | | |")
            continue
        pct = lambda key, p: (m.get(key) or {}).get(p)
        row = {"output_tokens_per_s": m.get("output_throughput"), "failed": m.get("num_failed")}
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            row[f"{key[:-3]}_p50_ms"], row[f"{key[:-3]}_p99_ms"] = pct(key, "p50"), pct(key, "p99")
        summary["servers"][mode][workload] = row
        base = offline.get(workload)
        ratio = row["output_tokens_per_s"] / base if base and row["output_tokens_per_s"] else None
        if workload == "single":
            ratio = row["tpot_p50_ms"] / step if step and row["tpot_p50_ms"] else None
            row["tpot_over_batch1_step"] = ratio
        else:
            row["over_offline"] = ratio
        hit = "" if ratio is None else (" hit" if (ratio <= 1.1 if workload == "single" else ratio >= 0.9) else " miss")
        print(f"| {mode} | {workload} | {fmt(row['output_tokens_per_s'], 0)} | "
              f"{fmt(ratio, 3)}{hit}{' (TPOT / batch-1 step, target <= 1.10)' if workload == 'single' else ''} | "
              f"{fmt(row['ttft_p50_ms'])} / {fmt(row['ttft_p99_ms'])} | {fmt(row['tpot_p50_ms'], 2)} / "
              f"{fmt(row['tpot_p99_ms'], 2)} | {fmt(row['itl_p50_ms'], 2)} / {fmt(row['itl_p99_ms'], 2)} | "
              f"{row['failed']} |")
print(f"\nEngine batch-1 decode step P50: {fmt(step, 3)} ms ({(engine.get('batch1') or {}).get('input_len')}-token "
      f"prompt, {(engine.get('batch1') or {}).get('output_len')} new tokens).")
overhead = summary["overhead"]
if overhead:
    print("\n## The server path alone (engine stand-in: 256 streams, 256 rows per 10 ms = 25,600 tok/s offered)\n")
    print("| mode | tok/s | event loop busy | loop us/token | ITL P99 ms |\n|---|---:|---:|---:|---:|")
    for mode, row in overhead["modes"].items():
        print(f"| {mode} | {fmt(row.get('output_tokens_per_s'), 0)} | {fmt(row.get('event_loop_share'), 2)} | "
              f"{fmt(row.get('event_loop_us_per_token'))} | {fmt(row.get('itl_ms_p99'))} |")
hf = summary["hf"]
if hf:
    print("\n## HF transformers on the same token ids\n")
    for line in hf.get("lines", []):
        print(line)
(w / "serve_at_limit.json").write_text(json.dumps(summary, indent=1))
EOF
cat "$W/serve_at_limit.md"
