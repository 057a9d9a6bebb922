#!/usr/bin/env bash
# Second two-GPU call: data parallel (DP=2) beside a diagnosis of tensor parallel on CUDA.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_DEBUG=WARN
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PAGEDKV_HANG_DUMP_S=35
export PAGEDKV_COMMIT=${PAGEDKV_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
( timeout 110 python3 -m pagedkv bench parallel dp2 --out "$OUT" > "$OUT/dp2.log" 2>&1 ) &
timeout 50 python3 benchmarks/diag_tp.py eager > "$OUT/tp_eager.log" 2>&1
timeout 50 python3 benchmarks/diag_tp.py graphs > "$OUT/tp_graphs.log" 2>&1
wait
tail -5 "$OUT/dp2.log"; grep -v "^ *$" "$OUT/tp_eager.log" | head -40; grep -v "^ *$" "$OUT/tp_graphs.log" | head -30
