#!/usr/bin/env bash
# KV bytes per sequence at 32K context, a table per layer group against every layer full length, on the
# Gemma-3-12B shape (random weights, bf16), measured from the engine's own allocation at a fixed pool.
#
# Run from the repository root (GPU: `OUT=$OUT bash benchmarks/tools/hybrid_kv.sh`); about 2-3 minutes on
# one H200 (model init, then 2 x 4 prefills of 32K tokens). Writes $OUT/hybrid_kv.md and .json: page size,
# blocks and bytes of each pool, KV per sequence while decoding, the sequences the pool admits at 32K.
# Environment: MODEL (random:gemma3-12b), CONTEXT (32768), POOL_GIB (24), NUM_SEQS (4), PYTHON (python3).
# CPU smoke: MODEL=random:tiny-gemma3 CONTEXT=96 POOL_GIB=0.001 NUM_SEQS=3 EXTRA="--device cpu --dtype float32
# --block-size 4 --chunk 32" PYTHON=/work/main/.venv/bin/python OUT=/tmp/hk bash benchmarks/tools/hybrid_kv.sh
set -u
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
MODEL=${MODEL:-random:gemma3-12b}; CONTEXT=${CONTEXT:-32768}; POOL_GIB=${POOL_GIB:-24}; NUM_SEQS=${NUM_SEQS:-4}
PY=${PYTHON:-python3}
# shellcheck disable=SC2086
timeout 900 $PY benchmarks/tools/hybrid_kv.py --out "$OUT" --model "$MODEL" --context "$CONTEXT" \
  --pool-gib "$POOL_GIB" --num-seqs "$NUM_SEQS" ${EXTRA:-} 2>&1 | tee "$OUT/hybrid_kv.log" | grep -v "^\s*$" | tail -20
