#!/usr/bin/env bash
# KV tiers on multi-turn chat (`pagedkv bench engine --preset chat-tiers`): no prefix cache, GPU-only prefix
# caching, and GPU + pinned host tier + disk tier on the same conversations (the same prompts in the same order:
# fixed answers drawn from the seed in the histories, 4 turns in flight, a GPU pool of ~10% of the distinct prefix
# blocks), then a restart on the same disk directory; Qwen3-0.6B and Llama-3-8B shapes with random weights, bf16.
# Before the configurations, per model, a warm-up pass runs another seed's workload through the tiers once, so
# that Triton's first-use compiles of the kernel variants each configuration needs stay out of the measured runs.
#
# Run from the repository root on the GPU machine: `OUT=$OUT bash benchmarks/tools/kv_tiers.sh` (on one H200 the
# two models took about 190 s with the default full graphs, 230 s with GRAPHS=off, whose prefill steps also compile
# kernel variants on first use; the bench is cut at CHAT_TIMEOUT_S (480 s), the layer-group case below at 120 s,
# which LAYER_GROUPS=0 skips). Writes $OUT/kv_tiers.json and
# $OUT/kv_tiers.md and prints the markdown: per model and configuration TTFT P50/P99, output tok/s, hit rates per
# tier, restored GB, the restore rate of the H2D copies alone and with the scatter into the pool, blocks per copy;
# then, each beside its target: TTFT vs GPU-only (>= 3x) next to the most a restore can win for one turn (its
# prefill against copying its prefix plus its message's prefill, measured in the run), output tok/s (>= 1x), the H2D
# copy rate against the pinned bandwidth measured in the same run (>= 80%), per configuration the steps' host
# seconds by phase (schedule, build, launch, wait for the device, update) with the slowest step and its shape, the
# warm turns' mean TTFT split into the same phases of the steps between submission and first token, and
# after the restart the share of distinct prompt blocks read from disk (>= 90%) and not computed, with the first
# request's TTFT. The "same prompts in every configuration" line compares the prompts each run actually sent.
# The measured H2D/D2H figures go into src/pagedkv/sim/data/cost_model_h200.json's "kv_tiers".
# Disk: up to 12 GiB per model in DIR, or HOST_MEMORY if larger (the tier's cap in this run), removed after each model.
# Environment: MODELS (default qwen3-0.6b,llama3-8b), HOST_MEMORY (default 16GiB), DIR (the disk tier's
# directory; default a fresh one under $TMPDIR), PYTHON.
# CPU smoke (about 20 s): SMOKE=1 OUT=/tmp/kvt bash benchmarks/tools/kv_tiers.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
PY=${PYTHON:-python3}
MODELS=${MODELS:-qwen3-0.6b,llama3-8b}
GRAPHS=${GRAPHS:-full}  # --mixed-step-graphs: full (the engine default) or off (prefill steps eager, faster starts)
HOST_MEMORY=${HOST_MEMORY:-16GiB}; [ "${SMOKE:-0}" = 1 ] && HOST_MEMORY=${SMOKE_HOST_MEMORY:-64MiB}
DIR=${DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kv_tiers.XXXXXX")}
start_log "$OUT"
EXTRA=(); [ "${SMOKE:-0}" = 1 ] && EXTRA=(--smoke)
[ "${PROFILE:-0}" = 1 ] && EXTRA+=(--profile-host)  # cProfile per configuration: host_profile_*.txt (slower runs)
# PROFILE=torch: torch.profiler per configuration, torch_profile_*.txt: ops and CUDA runtime calls by own host time
# (what in a step's launch waits for the device) and by device time (slower runs)
[ "${PROFILE:-0}" = torch ] && EXTRA+=(--profile-torch)
# GC=on: the garbage collector as it is during the measured runs (default freeze: the heap frozen before each run,
# as `pagedkv serve` does after startup; a full pass over an unfrozen heap stalls a step for a few hundred ms).
EXTRA+=(--gc "${GC:-freeze}")
# CHAT_SIZE=C,K,T,S,F: C conversations of T turns over K system prompts of S tokens, F in flight (every model), e.g.
# 32,16,3,8192,2: long shared prefixes, where recomputing a prefix costs more per token than copying it back.
[ -n "${CHAT_SIZE:-}" ] && EXTRA+=(--chat-size "$CHAT_SIZE")
# IN_STEP=T: one more configuration, the tiers copying at most T tokens' worth of restored blocks before a step's
# kernels (0: every restore beside the step, its request computing from the next step); about 30 s more per model.
[ -n "${IN_STEP:-}" ] && EXTRA+=(--in-step-restore-tokens "$IN_STEP")
# HOST_ONLY=1: one more configuration, the host tier without the disk tier (what the disk writers cost the steps).
[ "${HOST_ONLY:-0}" = 1 ] && EXTRA+=(--host-tier-only)
# WRITES_DURING_STEPS=1: one more configuration, the disk writers free to start while the step loop runs (the
# engine's default holds them until it waits for the device).
[ "${WRITES_DURING_STEPS:-0}" = 1 ] && EXTRA+=(--disk-writes-during-steps)
# LATE_RESTORE=1: one more configuration, the tiers with each restore's copies issued with the step's other block
# moves instead of at admission (the engine's default before early restores).
[ "${LATE_RESTORE:-0}" = 1 ] && EXTRA+=(--late-restore)
# WRITE_THROUGH=1: one more configuration, the tiers copying each committed block to the host tier ahead of any
# eviction (a cold turn's blocks are then on the host before the next turn evicts them).
[ "${WRITE_THROUGH:-0}" = 1 ] && EXTRA+=(--write-through)
# WRITER_PROCESS=1: one more configuration, the disk writes in a child process over a shared host pool.
[ "${WRITER_PROCESS:-0}" = 1 ] && EXTRA+=(--disk-writer-process)
say "models $MODELS, host tier $HOST_MEMORY, disk tier in $DIR ($(df -h "$DIR" | tail -1 | tr -s ' '))"
timeout "${CHAT_TIMEOUT_S:-480}" $PY -m pagedkv bench engine --preset chat-tiers --model "$MODELS" \
  --kv-offload-memory "$HOST_MEMORY" --kv-offload-dir "$DIR" --mixed-step-graphs "$GRAPHS" --out "$OUT" "${EXTRA[@]}" 2>&1 | tee "$OUT/kv_tiers.log" | grep -E "^\S+ \| " \
  | while read -r line; do say "$line"; done
say "exit ${PIPESTATUS[0]}"
rm -rf "$DIR"
[ -f "$OUT/kv_tiers.md" ] && cat "$OUT/kv_tiers.md"
# Layer groups (Gemma-3-1B shape, random weights, bf16; under a minute): 16 prompts of 2,048 tokens through a GPU pool
# of about two prompts' blocks, GPU-only against GPU + host + disk, then a restart: TTFT P50, where each group's hit
# blocks came from, restored bytes per prompt against every layer full length. Writes $OUT/kv_tiers_groups.json.
[ "${LAYER_GROUPS:-1}" = 1 ] || exit 0
GROUPS_ARGS=(--model gemma3-1b); [ "${SMOKE:-0}" = 1 ] && GROUPS_ARGS=(--model tiny-gemma3 --prompts 4 \
  --prompt-tokens 40 --question-tokens 6 --block-size 4 --device cpu --dtype float32 --host-bytes 1048576)
timeout 120 $PY benchmarks/tools/kv_tiers_groups.py --out "$OUT" "${GROUPS_ARGS[@]}" 2>&1 \
  | tee "$OUT/kv_tiers_groups.log" | grep -E "^\S+ \| " | while read -r line; do say "$line"; done
say "layer groups: exit ${PIPESTATUS[0]}"
