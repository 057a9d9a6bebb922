#!/usr/bin/env bash
# KV tiers on multi-turn chat (`pagedkv bench engine --preset chat-tiers`): no prefix cache, GPU-only prefix
# caching, and GPU + pinned host tier + disk tier on the same conversations, then a restart on the same disk
# directory; Qwen3-0.6B and Llama-3-8B shapes with random weights, bf16.
#
# Run from the repository root on the GPU machine: `OUT=$OUT bash benchmarks/tools/kv_tiers.sh` (about 4
# minutes on one H200). Writes $OUT/kv_tiers.json and $OUT/kv_tiers.md: per model and configuration TTFT
# P50/P99, output tok/s, hit rates per tier, KV copy bytes and device times, the pinned H2D/D2H bandwidths
# measured in the same run against the restore rate, and the restart's share of prompt blocks from disk and
# first-request TTFT. The measured H2D/D2H figures go into src/pagedkv/sim/data/cost_model_h200.json's
# "kv_tiers" (with "measured": true).
# Disk: up to 12 GiB per model in DIR (the tier's cap in this run), removed after each model.
# Environment: MODELS (default qwen3-0.6b,llama3-8b), HOST_MEMORY (default 16GiB), DIR (the disk tier's
# directory; default a fresh one under $TMPDIR), PYTHON.
# CPU smoke: SMOKE=1 OUT=/tmp/kvt bash benchmarks/tools/kv_tiers.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
PY=${PYTHON:-python3}
MODELS=${MODELS:-qwen3-0.6b,llama3-8b}
HOST_MEMORY=${HOST_MEMORY:-16GiB}; [ "${SMOKE:-0}" = 1 ] && HOST_MEMORY=${SMOKE_HOST_MEMORY:-64MiB}
DIR=${DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kv_tiers.XXXXXX")}
start_log "$OUT"
EXTRA=(); [ "${SMOKE:-0}" = 1 ] && EXTRA=(--smoke)
say "models $MODELS, host tier $HOST_MEMORY, disk tier in $DIR ($(df -h "$DIR" | tail -1 | tr -s ' '))"
timeout 420 $PY -m pagedkv bench engine --preset chat-tiers --model "$MODELS" --kv-offload-memory "$HOST_MEMORY" \
  --kv-offload-dir "$DIR" --out "$OUT" "${EXTRA[@]}" 2>&1 | tee "$OUT/kv_tiers.log" | grep -E "^\S+ \| " \
  | while read -r line; do say "$line"; done
say "exit ${PIPESTATUS[0]}"
rm -rf "$DIR"
[ -f "$OUT/kv_tiers.md" ] && cat "$OUT/kv_tiers.md"
