#!/usr/bin/env bash
# `pagedkv serve` + `pagedkv bench serve` against the offline engine on the same requests, and where
# the server's time goes. One call on one GPU (about 3-5 minutes on an H200); from the repository root:
#
#     git rev-parse --short HEAD > .commit
#     OUT=/tmp/out bash benchmarks/tools/serve_vs_engine.sh          # carry .whl and .commit
#
# Phases, each under `timeout` and inside $BUDGET_S (default 540 s) in all:
#   1. wheels: .whl/*.whl (FastAPI, uvicorn, pydantic, httpx, ... at constraints.txt's pins) into a
#      temporary site dir on PYTHONPATH, when .whl exists;
#   2. serve_vs_engine.py engine: nano-vllm's workload offline (and stepped with stream_outputs on),
#      a batch-1 stream; writes the request lists bench serve replays (`--dataset ids`);
#   3. one server (serve_profiled.py: `pagedkv serve` plus measurement windows) on 127.0.0.1, then
#      bench serve, each in its own window and on its own requests (so no run hits another's
#      prefix cache): a warm-up; serve_sat (requests.json, rate inf, streaming: the headline);
#      serve_single (one client, 128-token prompts, 256 tokens); serve_sat_sampled (stack sampler
#      every 5 ms); serve_nostream; serve_sat_cprofile (cProfile on the loop and engine threads;
#      CPROFILE=0 skips it);
#   4. the server stopped with SIGINT (SIGKILL after 30 s; also on any exit, by trap), then
#      serve_vs_engine.py report: one table.
# $OUT gets summary.md, summary.json, serve_vs_engine.log and results.tgz (everything: engine.json,
# each run's serve.json, each window's profile JSON with collapsed stacks, the server log).
#
# Environment (defaults are the GPU run): MODEL (random:qwen3-0.6b), NUM_REQUESTS (256), MIN_LEN
# (100), MAX_LEN (1024), MAX_MODEL_LEN (4096), MAX_NUM_SEQS (256), MAX_NUM_BATCHED_TOKENS (8192),
# KV_CACHE_MEMORY (0.3), DEVICE (engine default), SINGLE_IN (128), SINGLE_OUT (256), PORT (8123),
# CPROFILE (1), BUDGET_S (540), PYTHON (python3), WHEELS (.whl; a folder without wheels skips them). CPU smoke:
#     MODEL=random:tiny-llama NUM_REQUESTS=16 MIN_LEN=8 MAX_LEN=32 MAX_MODEL_LEN=256 SINGLE_IN=16 \
#       SINGLE_OUT=16 KV_CACHE_MEMORY=64MiB DEVICE=cpu OMP_NUM_THREADS=1 PYTHON=.venv/bin/python WHEELS=none OUT=/tmp/sve bash benchmarks/tools/serve_vs_engine.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-random:qwen3-0.6b}
NUM_REQUESTS=${NUM_REQUESTS:-256}; MIN_LEN=${MIN_LEN:-100}; MAX_LEN=${MAX_LEN:-1024}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-8192}; KV_CACHE_MEMORY=${KV_CACHE_MEMORY:-0.3}
DEVICE=${DEVICE:-}; SINGLE_IN=${SINGLE_IN:-128}; SINGLE_OUT=${SINGLE_OUT:-256}
PORT=${PORT:-8123}; CPROFILE=${CPROFILE:-1}; BUDGET_S=${BUDGET_S:-540}
PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}
W=$(mktemp -d "${TMPDIR:-/tmp}/serve_vs_engine.XXXXXX")  # work dir; $OUT gets four files from it
start_log "$W"
LOG="$W/serve_vs_engine.log"
SERVER_PID=""

stop_server() {  # SIGINT: uvicorn drains and the engine thread stops; SIGKILL if it hangs
  [ -n "$SERVER_PID" ] || return 0
  kill -INT "$SERVER_PID" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$SERVER_PID" 2>/dev/null && { say "server did not stop in 30 s: SIGKILL"; kill -KILL "$SERVER_PID"; }
  wait "$SERVER_PID" 2>/dev/null; say "server exited with status $?"
  SERVER_PID=""
}
pack() {
  rm -rf "$W/site"
  tar czf "$OUT/results.tgz" -C "$W" . 2>/dev/null
  cp "$W/summary.log" "$LOG" 2>/dev/null
  cp "$LOG" "$OUT/serve_vs_engine.log"
  for f in summary.md summary.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"; done
}
trap 'stop_server; pack' EXIT
trap 'exit 130' INT TERM

left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# `limit N`: a phase's timeout, N s or what the budget leaves (keeping 40 s to stop and report).
limit() { local l=$(( $(left) - 40 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
phase() {  # phase NAME LIMIT_S CMD...: run under timeout, log its output, say how it went
  local name=$1 t; t=$(limit "$2"); shift 2
  if [ "$t" -lt 10 ]; then say "$name: skipped, budget spent"; return 1; fi
  local s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$W/$name.log" 2>&1; local rc=$?
  say "$name: exit $rc in $(( $(date +%s) - s )) s$( [ $rc -eq 124 ] && echo " (timed out at $t s)")"
  return $rc
}

say "commit $PAGEDKV_COMMIT; $(nvidia-smi -L 2>/dev/null | head -1); $($PY --version 2>&1)"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE="$W/site"
  if $PY -m pip --version >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
      > "$W/wheels.log" 2>&1 || say "pip install of .whl failed (see wheels.log)"
  else  # no pip: a wheel is a zip of its site-packages files
    $PY -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" "$SITE" "$WHEELS"/*.whl
  fi
  export PYTHONPATH="src:$SITE"
fi
$PY -c "import fastapi, uvicorn, pydantic, httpx, prometheus_client, torch; print('fastapi', fastapi.__version__, \
'uvicorn', uvicorn.__version__, 'pydantic', pydantic.__version__, 'httpx', httpx.__version__, 'torch', torch.__version__, \
'cuda' if torch.cuda.is_available() else 'no cuda')" > "$W/imports.log" 2>&1
say "imports: $(tail -1 "$W/imports.log")"

DEVICE_FLAG=(); [ -n "$DEVICE" ] && DEVICE_FLAG=(--device "$DEVICE")
ENGINE_FLAGS=(--max-model-len "$MAX_MODEL_LEN" --max-num-seqs "$MAX_NUM_SEQS"
              --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --kv-cache-memory "$KV_CACHE_MEMORY" "${DEVICE_FLAG[@]}")
phase engine 240 $PY benchmarks/tools/serve_vs_engine.py engine --out "$W" --model "$MODEL" \
  --num-requests "$NUM_REQUESTS" --min-len "$MIN_LEN" --max-len "$MAX_LEN" --single-input-len "$SINGLE_IN" \
  --single-output-len "$SINGLE_OUT" "${ENGINE_FLAGS[@]}"
grep -E "^(engine up|offline|batch 1)" "$W/engine.log" | while read -r line; do say "  $line"; done
[ -f "$W/requests.json" ] || { say "no request files: the engine phase failed"; tail -20 "$W/engine.log"; exit 1; }

$PY benchmarks/tools/serve_profiled.py --profile-dir "$W/profile" -- "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --log-level warning "${ENGINE_FLAGS[@]}" > "$W/server.log" 2>&1 &
SERVER_PID=$!
post() {  # post PATH: POST to the server, print the JSON answer
  $PY -c "import sys, urllib.request
try: print(urllib.request.urlopen(urllib.request.Request(sys.argv[1], method='POST'), timeout=60).read().decode())
except Exception as e: print(f'{type(e).__name__}: {e}', (e.read()[:300] if hasattr(e, 'read') else b'').decode())
" "http://127.0.0.1:$PORT$1" 2>&1
}
up=0; deadline=$(( $(date +%s) + $(limit 240) ))
while [ "$(date +%s)" -lt "$deadline" ] && kill -0 "$SERVER_PID" 2>/dev/null; do
  $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null \
    && { up=1; break; }
  sleep 1
done
if [ $up -ne 1 ]; then say "server not healthy (see server.log):"; tail -20 "$W/server.log"; exit 1; fi
say "server up (pid $SERVER_PID)"

BENCH=($PY -m pagedkv bench serve --base-url "http://127.0.0.1:$PORT" --dataset ids --request-rate inf
       --ignore-eos --disable-tqdm)
# window NAME MODE LIMIT_S REQUESTS_FILE NUM [extra bench flags]: one bench serve run in one window
window() {
  local name=$1 mode=$2 t=$3 file=$4 num=$5; shift 5
  say "$name: $(post "/profile/start?name=$name&mode=$mode")"
  phase "$name" "$t" "${BENCH[@]}" --dataset-path "$W/$file" --num-prompts "$num" --out "$W/$name" "$@"
  say "$name: $(post /profile/stop)"
  grep -E "Output token throughput|^(TTFT|TPOT|ITL) |failed requests|errors" "$W/$name.log" \
    | while read -r line; do say "  $line"; done
}
phase warmup 120 "${BENCH[@]}" --dataset-path "$W/requests_warm.json" --num-prompts 8 --out "$W/warmup"
window serve_sat steps 150 requests.json "$NUM_REQUESTS"
window serve_single steps 90 requests_single.json 6 --max-concurrency 1
window serve_sat_sampled sample 150 requests_s1.json "$NUM_REQUESTS"
window serve_nostream steps 150 requests_s3.json "$NUM_REQUESTS" --no-stream
[ "$CPROFILE" = 1 ] && window serve_sat_cprofile cprofile 180 requests_s2.json "$NUM_REQUESTS"
stop_server
tail -5 "$W/server.log" | while read -r line; do say "  server: $line"; done
phase report 60 $PY benchmarks/tools/serve_vs_engine.py report --out "$W"
cat "$W/summary.md" 2>/dev/null | head -60
say "done; $OUT: summary.md, summary.json, serve_vs_engine.log, results.tgz"
