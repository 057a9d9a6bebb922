# Shared by the serving scripts (serve_at_limit.sh, latency_under_load.sh); sourced after benchmarks/gpu_env.sh,
# with PY, WHEELS, PORT, BUDGET_S and NAME (the results' file name) set; SLOW=N stretches every phase's limit
# N times (a CPU smoke run). Makes the work dir W, starts the log,
# and on exit stops the server and copies $W/NAME.* and summary.log to $OUT, with everything in results.tgz.
W=$(mktemp -d "${TMPDIR:-/tmp}/$NAME.XXXXXX")
start_log "$W"
SERVER_PID=""
stop_server() {  # SIGINT: uvicorn drains and stops; SIGKILL if it hangs
  [ -n "$SERVER_PID" ] || return 0
  kill -INT "$SERVER_PID" 2>/dev/null
  for _ in $(seq 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$SERVER_PID" 2>/dev/null && { say "server did not stop in 20 s: SIGKILL"; kill -KILL "$SERVER_PID"; }
  wait "$SERVER_PID" 2>/dev/null; SERVER_PID=""
}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
phase() {  # phase NAME LIMIT_S CMD...: under timeout (LIMIT_S x $SLOW, never past the budget), output to $W/NAME.log
  local name=$1 t=$(( $2 * ${SLOW:-1} )); shift 2
  local l=$(( $(left) - 15 )); [ "$l" -lt "$t" ] && t=$l
  if [ "$t" -lt 5 ]; then say "$name: skipped, budget spent"; return 1; fi
  local s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$W/$name.log" 2>&1; local rc=$?
  say "$name: exit $rc in $(( $(date +%s) - s )) s$( [ $rc -eq 124 ] && echo " (timed out at $t s)")"
  return $rc
}
install_wheels() {  # the server's dependencies from $WHEELS/*.whl into $W/site (no network on the GPU machine)
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || return 0
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" "$WHEELS"/*.whl \
    > "$W/wheels.log" 2>&1 || $PY -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
    "$W/site" "$WHEELS"/*.whl
  export PYTHONPATH="src:$W/site"
}
start_server() {  # start_server LOG ARGS...: `pagedkv serve ARGS` in the background, then wait for /health
  local log=$1; shift
  $PY -m pagedkv serve "$@" --host 127.0.0.1 --port "$PORT" --log-level warning > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 150); do
    $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    say "server up (pid $SERVER_PID): $*"
  else
    wait "$SERVER_PID" 2>/dev/null; say "server exited with status $? before answering /health: $* (see $(basename "$log"))"
    SERVER_PID=""
  fi
}
pack() { rm -rf "$W/site"; cp "$W/$NAME".* "$W/summary.log" "$OUT/" 2>/dev/null; tar czf "$OUT/results.tgz" -C "$W" . 2>/dev/null; }
trap 'stop_server; pack' EXIT
trap 'exit 130' INT TERM
