#!/usr/bin/env bash
# One replica through the Ray Serve app (`pagedkv serve --ray`) against direct `pagedkv serve`, same requests.
#
#   OUT=$OUT bash benchmarks/tools/ray_vs_serve.sh     # GPU machine: carry .whl (server wheels), .ray and .commit
#
# .ray/ray-site.tar.xz is Ray and what Serve imports beyond the machine's image (benchmarks/tools/ray_carry.sh
# builds it); it is unpacked into $SITE with the server wheels from $WHEELS. Then for each of MODES in turn:
#   serve        direct `pagedkv serve` (first, so a Ray that does not stop cleanly cannot hold the GPU it needs)
#   ray          `pagedkv serve --ray`: Serve's HTTP proxy, the ingress replica, one engine replica
#   ray-direct   the same with Ray Serve's direct ingress (`--direct-ingress`: no proxy hop; the ingress listens
#                on PORT + 1)
#   ray-separate ray-direct with Serve's user code and handle routers on a thread and loop of their own
#                (`--ray-separate-loops`; the app's default runs them on each replica's own event loop)
#   ray-nolanes  ray-direct with requests sent to the engine replica by Ray Serve calls alone (`--ray-no-lanes`; the
#                app's default also sends each one by its lane, a TCP connection from the ingress to the replica)
#   ray-loop     ray-direct with each engine replica's engine process driven from the replica's event loop, without
#                its engine thread (`--ray-replica-on-loop`)
#   ray-opt      the same with RAY_SERVE_THROUGHPUT_OPTIMIZED=1: Ray's preset of direct ingress, user code and
#                routers on the replica's main event loop, gRPC between handles and replicas, a frozen heap
# each with its default engine placement (a process of its own on CUDA, a thread on CPU; a -engine-process or
# -in-process suffix forces one). Start the server, wait for /health, then with `pagedkv bench serve`:
#   warm   requests_warm.json, then 64 random requests (WARM_IN in, WARM_OUT out) at full rate
#   sat    SAT_REPEATS (3) times on the same server, the median reported beside each run's figure:
#          requests.json at full rate: nano-vllm's workload shape (NUM_REQUESTS requests, prompts and outputs of
#          MIN_LEN..MAX_LEN random token ids, ignore_eos), as serve_at_limit.sh runs it: output tok/s
#   low    LOW_PROMPTS requests of LOW_IN tokens in, LOW_OUT out, one at a time: TTFT P50 at low load
# Writes $OUT/ray_vs_serve.md and .json (each server's figures; per Ray mode the saturated throughput ratio,
# target >= 0.95x, and the TTFT P50 it adds at low load, target <= 3 ms) and results.tgz (every log, Ray's too).
# About 7 minutes on an H200 for three modes (server starts with graph capture, Ray's take ~60 s); BUDGET_S (500)
# bounds it. Direct serve's throughput moves between server starts and hosts (14k-25k tok/s on the H200 over the
# runs so far), so compare modes within one run (each mode once in MODES), and run the script again to see the
# spread between starts. INTERLEAVE=1 (MODES="serve <one Ray mode>") starts both servers at once (serve on
# PORT + 100) and alternates their saturated runs, so the host's drift moves both alike; a CPU smoke of it runs
# in about a minute (the command below with INTERLEAVE=1 MODES="serve ray-direct" SAT_REPEATS=2).
# Benchmarks never assert.
# CPU smoke from a clean python (the local check of the archive; `PY_VERSION=3.11 bash benchmarks/tools/ray_carry.sh`
# first; PYTHONPATH_EXTRA holds torch, transformers and the server's packages, as the GPU image and .whl do):
#   MODEL=random:tiny-llama VOCAB=512 NUM_REQUESTS=32 MIN_LEN=8 MAX_LEN=48 LOW_PROMPTS=8 LOW_IN=16 LOW_OUT=4 WARM_IN=16 \
#   WARM_OUT=8 MAX_MODEL_LEN=256 DEVICE=cpu WHEELS=none RAY_ARCHIVE=/work/ray-carry/ray-site-cp311.tar.xz \
#   PYTHONPATH_EXTRA=... PYTHON=python3.11 OUT=/tmp/rvs bash benchmarks/tools/ray_vs_serve.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-random:qwen3-0.6b}; VOCAB=${VOCAB:-151936}  # token ids are drawn below VOCAB (the model's)
NUM_REQUESTS=${NUM_REQUESTS:-256}; MIN_LEN=${MIN_LEN:-100}; MAX_LEN=${MAX_LEN:-1024}
LOW_PROMPTS=${LOW_PROMPTS:-64}; LOW_IN=${LOW_IN:-128}; LOW_OUT=${LOW_OUT:-16}; WARM_IN=${WARM_IN:-256}; WARM_OUT=${WARM_OUT:-64}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; DEVICE=${DEVICE:-}; PORT=${PORT:-8125}; BUDGET_S=${BUDGET_S:-500}
SAT_REPEATS=${SAT_REPEATS:-3}  # saturated runs per server start (the same requests; ~10 s each on an H200)
# serve and ray place the engine by default (own process on CUDA, a thread on CPU); a -engine-process or
# -in-process suffix forces it. ray-direct is ray with Ray Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1:
# HTTP reaches the ingress replica on a port of its own, PORT + 1 here, without the proxy's hop). Each ray mode is
# compared with the serve mode of the same suffix, else serve.
MODES=${MODES:-"serve ray ray-direct"}
PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}; RAY_ARCHIVE=${RAY_ARCHIVE:-.ray/ray-site.tar.xz}
SITE=${SITE:-/tmp/ray-site}
# No usage report (no network), no memory monitor (it reads cgroup files a sandboxed kernel may not fill in).
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0 RAY_memory_monitor_refresh_ms=0
W=$(mktemp -d "${TMPDIR:-/tmp}/ray_vs_serve.XXXXXX")
start_log "$W"
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# `ray stop --force` ends every Ray process of the machine: right on the GPU machine, wrong on a shared one.
RAY_STOP=${RAY_STOP:-$(command -v nvidia-smi > /dev/null && echo 1 || echo 0)}
declare -A PIDS URLS  # per mode: its server's pid and base URL
stop_all() {  # the server (or with none named, every one still up), then any Ray process left behind
  if [ -n "$SERVER_PID" ]; then
    stop_server 45
  else
    for pid in "${PIDS[@]}"; do SERVER_PID=$pid; stop_server 45; done
  fi
  [ "$RAY_STOP" = 1 ] && timeout 60 $PY -m ray.scripts.scripts stop --force > /dev/null 2>&1
  return 0
}
trap 'SERVER_PID=; stop_all; cp "$W"/ray_vs_serve.* "$W"/ray_hops.json "$W"/hops.log "$W/summary.log" "$OUT/" 2>/dev/null; tar czf "$OUT/results.tgz" -C "$W" . 2>/dev/null' EXIT
trap 'exit 130' INT TERM

# Ray and the server's wheels, unpacked (no network here); PYTHONPATH absolute, as Ray's workers inherit it.
if [ -f "$RAY_ARCHIVE" ]; then
  mkdir -p "$SITE"
  $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$RAY_ARCHIVE" "$SITE"
  say "unpacked $RAY_ARCHIVE into $SITE: exit $?"
fi
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    > "$W/wheels.log" 2>&1 || $PY -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
    "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH_EXTRA:+:$PYTHONPATH_EXTRA}"
say "commit $PAGEDKV_COMMIT; $(nvidia-smi -L 2>/dev/null | head -1); $($PY --version 2>&1); ray $($PY -c 'import ray; print(ray.__version__)' 2>&1 | tail -1)"

# The request files (the same token ids for both servers).
$PY - "$W" "$NUM_REQUESTS" "$MIN_LEN" "$MAX_LEN" "$VOCAB" <<'EOF'
import json, sys
from pathlib import Path
from pagedkv.bench.engine import nano_vllm_workload
out, num, lo, hi, vocab = Path(sys.argv[1]), *map(int, sys.argv[2:])
for name, args in (("requests.json", (num, lo, hi, 0)), ("requests_warm.json", (8, max(1, lo // 4), max(2, hi // 8), 20_000))):
    prompts, output_lens = nano_vllm_workload(*args, vocab)
    (out / name).write_text(json.dumps([{"prompt_token_ids": p, "max_tokens": n} for p, n in zip(prompts, output_lens)]))
EOF

DEVICE_FLAG=(); [ -n "$DEVICE" ] && DEVICE_FLAG=(--device "$DEVICE")
FLAGS=(--max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens 8192 --kv-cache-memory 0.3
       "${DEVICE_FLAG[@]}")
phase() {  # phase NAME LIMIT_S ARGS...: one `bench serve` run under timeout, never past the budget
  local name=$1 t=$2; shift 2
  local l=$(( $(left) - 60 )); [ "$l" -lt "$t" ] && t=$l
  [ "$t" -lt 5 ] && { say "$name: skipped, budget spent"; return 1; }
  timeout -k 5 "$t" "${BENCH[@]}" --out "$W/$name" "$@" > "$W/$name.log" 2>&1
  say "$name: exit $? $(grep -E 'Output token throughput|^TTFT ' "$W/$name.log" | tr -s ' ' | tr '\n' ' ')"
}
# PYSPY=1: during the second saturated run, py-spy (carried as a wheel in .whl) samples each server process for
# PYSPY_S seconds (8), its children too (the engine process): `serve`'s server; a Ray mode's ingress replica and
# engine replica. Collapsed stacks in pyspy_<mode>_<role>.txt, their top frames in pyspy_<mode>.top
# (benchmarks/tools/collapsed_top.py). Sampling does not pause the processes (--nonblocking).
PYSPY_BIN=$(ls "$SITE"/bin/py-spy "$SITE"/py_spy-*.data/scripts/py-spy 2>/dev/null | head -1)
[ -n "$PYSPY_BIN" ] && chmod +x "$PYSPY_BIN" 2>/dev/null
PROFILERS=()
profile_server() {
  [ -z "$PYSPY_BIN" ] && { say "py-spy: not carried"; return; }
  local mode=$1 role pid
  PROFILERS=()
  for role in server ingress engine; do
    case $role in
      server) [ "${mode#ray}" = "$mode" ] && pid=$SERVER_PID || continue ;;
      ingress) [ "${mode#ray}" != "$mode" ] && pid=$(pgrep -f "ServeReplica:pagedkv:PagedKVIngress" | head -1) || continue ;;
      engine) [ "${mode#ray}" != "$mode" ] && pid=$(pgrep -f "ServeReplica:pagedkv:PagedKVEngine" | head -1) || continue ;;
    esac
    [ -z "$pid" ] && { say "py-spy: no $role process"; continue; }
    "$PYSPY_BIN" record --pid "$pid" --subprocesses --nonblocking --threads --rate 200 --duration "${PYSPY_S:-8}" \
      --format raw -o "$W/pyspy_${mode}_$role.txt" > "$W/pyspy_${mode}_$role.log" 2>&1 &
    PROFILERS+=($!)
  done
}
wait_profiles() {
  [ ${#PROFILERS[@]} = 0 ] && return
  wait "${PROFILERS[@]}" 2>/dev/null
  PROFILERS=()
  $PY benchmarks/tools/collapsed_top.py "$W"/pyspy_"$1"_*.txt > "$W/pyspy_$1.top" 2>&1
  say "py-spy $1: $(head -c 300 "$W/pyspy_$1.top" | tr '\n' ' ')"
  cp "$W"/pyspy_"$1"* "$OUT/" 2>/dev/null
}

start_mode() {  # start_mode MODE PORT: MODE's server on PORT (a direct ingress on PORT + 1); 0 once /health answers
  local mode=$1 port=$2 extra=() envs=() direct started up=0
  URLS[$mode]="http://127.0.0.1:$port"
  case $mode in ray*) extra+=(--ray) ;; serve*) ;; *) say "unknown mode $mode"; return 1 ;; esac
  case $mode in *-engine-process) extra+=(--engine-process) ;; *-in-process) extra+=(--in-process) ;; esac
  direct=(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=$((port + 1))
          RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=1)  # no load balancer to leave
  case $mode in ray-direct*) envs=("${direct[@]}"); extra+=(--direct-ingress); URLS[$mode]="http://127.0.0.1:$((port + 1))" ;;
                ray-separate*) envs=("${direct[@]}"); extra+=(--direct-ingress --ray-separate-loops)
                               URLS[$mode]="http://127.0.0.1:$((port + 1))" ;;
                ray-nolanes*) envs=("${direct[@]}"); extra+=(--direct-ingress --ray-no-lanes)
                              URLS[$mode]="http://127.0.0.1:$((port + 1))" ;;
                ray-loop*) envs=("${direct[@]}"); extra+=(--direct-ingress --ray-replica-on-loop)
                           URLS[$mode]="http://127.0.0.1:$((port + 1))" ;;
                ray-opt*) envs=(RAY_SERVE_THROUGHPUT_OPTIMIZED=1 "${direct[@]}"); URLS[$mode]="http://127.0.0.1:$((port + 1))" ;; esac
  started=$(date +%s)
  env "${envs[@]}" $PY -m pagedkv serve "$MODEL" --host 127.0.0.1 --port "$port" --log-level warning "${FLAGS[@]}" \
    "${extra[@]}" > "$W/server_$mode.log" 2>&1 &
  PIDS[$mode]=$!
  for _ in $(seq 300); do  # /health answers 200 only once the app is deployed (Serve's proxy 404s before)
    $PY -c "import urllib.request; urllib.request.urlopen('${URLS[$mode]}/health', timeout=2)" 2>/dev/null && { up=1; break; }
    kill -0 "${PIDS[$mode]}" 2>/dev/null || break
    sleep 1
  done
  say "$mode: up=$up after $(( $(date +%s) - started )) s"
  [ $up = 1 ] || tail -20 "$W/server_$mode.log"
  [ $up = 1 ]
}
stop_mode() {  # Ray's own logs first (the tail of each), for a replica that failed; then the server, and Ray
  local mode=$1
  if [ "${mode#ray}" != "$mode" ]; then
    mkdir -p "$W/ray-logs-$mode"
    for f in /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/serve/*.log; do
      [ -s "$f" ] && tail -c 100000 "$f" > "$W/ray-logs-$mode/$(basename "$f")"
    done
  fi
  SERVER_PID=${PIDS[$mode]:-}
  stop_all
  unset "PIDS[$mode]"
}
on() {  # on MODE: the next phases load MODE's server
  BENCH=($PY -m pagedkv bench serve --base-url "${URLS[$1]}" --request-rate inf --ignore-eos --seed 0 --disable-tqdm)
  SERVER_PID=${PIDS[$1]}
}
warm() {
  on "$1"
  phase "$1-warm" 120 --dataset ids --dataset-path "$W/requests_warm.json" --num-prompts 8
  phase "$1-warm2" 120 --dataset random --random-input-len "$WARM_IN" --random-output-len "$WARM_OUT" --num-prompts 64 \
    --vocab-size "$VOCAB"
}
saturated() {  # saturated MODE K: the K-th saturated run (py-spy on the second with PYSPY=1)
  on "$1"
  [ "$2" = 2 ] && [ "${PYSPY:-0}" = 1 ] && profile_server "$1"
  phase "$1-sat$([ "$2" = 1 ] || echo "$2")" 200 --dataset ids --dataset-path "$W/requests.json" \
    --num-prompts "$NUM_REQUESTS"
  [ "$2" = 2 ] && wait_profiles "$1"
  return 0
}
low_load() {
  on "$1"
  phase "$1-low" 120 --dataset random --random-input-len "$LOW_IN" --random-output-len "$LOW_OUT" \
    --num-prompts "$LOW_PROMPTS" --max-concurrency 1 --vocab-size "$VOCAB"
  # /health after the runs: per replica, whether the ingress had a lane to it and how many requests went in by it
  $PY -c "import urllib.request; print(urllib.request.urlopen('${URLS[$1]}/health', timeout=5).read().decode())" \
    > "$W/health_$1.json" 2>&1
  say "$1 health: $(head -c 400 "$W/health_$1.json")"
}

if [ "${INTERLEAVE:-0}" = 1 ]; then
  # Both servers up at once (each KV pool is --kv-cache-memory 0.3 of the GPU), their saturated runs taking
  # turns: the host's drift between runs then moves both alike, and the ratio is read from neighbouring runs.
  # MODES holds one serve mode and one Ray mode; the serve mode listens on PORT + 100.
  set -- $MODES
  if [ $# = 2 ] && start_mode "$1" $(( PORT + 100 )) && start_mode "$2" "$PORT"; then
    warm "$1"; warm "$2"
    for k in $(seq "$SAT_REPEATS"); do saturated "$1" "$k"; saturated "$2" "$k"; done
    low_load "$1"; low_load "$2"
  else
    [ $# = 2 ] || say "INTERLEAVE=1 takes two modes (serve, then one Ray mode), not: $MODES"
  fi
  for mode in $2 $1; do [ -n "${PIDS[$mode]:-}" ] && stop_mode "$mode"; done  # Ray's first: `ray stop` ends it
else
  for mode in $MODES; do
    [ "$(left)" -lt 120 ] && { say "$mode: skipped, budget spent"; continue; }
    if start_mode "$mode" "$PORT"; then
      warm "$mode"
      for k in $(seq "$SAT_REPEATS"); do saturated "$mode" "$k"; done
      low_load "$mode"
    fi
    stop_mode "$mode"
  done
fi

if [ "${HOPS:-0}" = 1 ]; then
  if [ "$(left)" -gt 150 ]; then
    # One settings group by default (HOPS_GROUPS=default,same-loop,throughput for all): on an H200 each engine
    # deployment takes ~30 s to start (graph capture), and all three groups passed 160 s.
    MODEL=$MODEL DEVICE=${DEVICE:-cuda} timeout -k 5 $(( $(left) - 30 )) $PY benchmarks/tools/ray_hops.py --out "$W" \
      --groups "${HOPS_GROUPS:-default}" \
      > "$W/hops.log" 2>&1
    say "hops: exit $?"
    sed -n '/^group /,/^wrote /p' "$W/hops.log"
    stop_all
  else
    say "hops: skipped, budget spent"
  fi
fi

$PY - "$W" "$MODES" <<'EOF' > "$W/ray_vs_serve.md"
import json, os, sys
from pathlib import Path
w, modes = Path(sys.argv[1]), sys.argv[2].split()

def summary(name):
    path = w / name / "serve.json"
    return json.loads(path.read_text())["runs"][0]["summary"] if path.is_file() else None

def p50(m, key):
    return round(m[key]["p50"], 2) if m and m.get(key) else None

result = {"benchmark": "ray_vs_serve", "commit": os.environ.get("PAGEDKV_COMMIT")}
rows = []
for mode in modes:
    sats = [s for s in (summary(f"{mode}-sat" + (str(k) if k > 1 else "")) for k in range(1, 10)) if s]
    # the saturated run of median throughput (servers swing between runs; see the README of the results)
    sat = sorted(sats, key=lambda s: s["output_throughput"])[len(sats) // 2] if sats else None
    low = summary(f"{mode}-low")
    result[mode] = {"sat_output_tokens_per_s": sat and sat["output_throughput"], "sat_failed": sat and sat["num_failed"],
                    "sat_runs_output_tokens_per_s": [s["output_throughput"] for s in sats],
                    "sat_ttft_p50_ms": p50(sat, "ttft_ms"), "sat_tpot_p50_ms": p50(sat, "tpot_ms"),
                    "low_ttft_p50_ms": p50(low, "ttft_ms"), "low_tpot_p50_ms": p50(low, "tpot_ms"),
                    "low_failed": low and low["num_failed"]}
    r = result[mode]
    tps = (f"{r['sat_output_tokens_per_s']:,.0f} ({', '.join(f'{t:,.0f}' for t in r['sat_runs_output_tokens_per_s'])})"
           if r["sat_output_tokens_per_s"] else "(no result)")
    rows.append(f"| {mode} | {tps} | {r['sat_ttft_p50_ms']} | {r['sat_tpot_p50_ms']} | {r['low_ttft_p50_ms']} "
                f"| {r['low_tpot_p50_ms']} | {r['sat_failed']} / {r['low_failed']} |")
for mode in modes:
    if not mode.startswith("ray"):
        continue
    ray, direct = result[mode], result.get("serve" + mode[3:], result.get("serve", {}))
    if direct.get("sat_output_tokens_per_s") and ray["sat_output_tokens_per_s"]:
        ray["throughput_ratio"] = round(ray["sat_output_tokens_per_s"] / direct["sat_output_tokens_per_s"], 3)
    if direct.get("low_ttft_p50_ms") is not None and ray["low_ttft_p50_ms"] is not None:
        ray["ttft_p50_added_ms"] = round(ray["low_ttft_p50_ms"] - direct["low_ttft_p50_ms"], 2)
(w / "ray_vs_serve.json").write_text(json.dumps(result, indent=2))
print(f"# One replica through Ray Serve vs direct pagedkv serve (commit {result['commit']})\n")
print("| server | saturated output tok/s, median (each run) | sat TTFT P50 ms | sat TPOT P50 ms | low-load TTFT P50 ms "
      "| low-load TPOT P50 ms | failed (sat / low) |\n|---|---:|---:|---:|---:|---:|---:|")
print("\n".join(rows))
for mode in modes:
    if mode.startswith("ray"):
        print(f"\n{mode}: throughput ratio {result[mode].get('throughput_ratio')} (target >= 0.95); "
              f"TTFT P50 added at low load {result[mode].get('ttft_p50_added_ms')} ms (target <= 3)")
EOF
cat "$W/ray_vs_serve.md"
