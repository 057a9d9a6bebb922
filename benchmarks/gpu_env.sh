# Sourced by benchmarks/gpu_run.sh: run from source, unbuffered, NVLink multicast off (it is off on the
# H200 machines), the commit the results name (`.commit`, carried to the device), and $OUT.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PAGEDKV_COMMIT=${PAGEDKV_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# The GPU tests as the runner runs them (no repo addopts such as the CPU timeout; failures summarised).
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -q -rf --tb=short"
# `start_log DIR`: results go to $R=DIR; `say ...` prints a line with the seconds since start_log, also
# into $R/summary.log. `finish_log` packs $R into $OUT/results.tgz and prints the summary's tail.
start_log() { R=$1; mkdir -p "$R"; T0=$(date +%s); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/summary.log"; }
finish_log() { say "done"; tar czf "$OUT/results.tgz" -C "$R" . ; cp "$R/summary.log" "$OUT/"; tail -c 11000 "$R/summary.log"; }
# `stop_server [WAIT_S]`: a server started in the background as $SERVER_PID gets SIGINT (it drains and stops),
# then SIGKILL if it is still there after WAIT_S seconds (default 30).
SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -INT "$SERVER_PID" 2>/dev/null
  for _ in $(seq $(( ${1:-30} * 2 ))); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
  wait "$SERVER_PID" 2>/dev/null; SERVER_PID=""
}
