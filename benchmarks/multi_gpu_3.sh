#!/usr/bin/env bash
# Two-GPU call (nvidia-h200-x2), part A: is tensor parallelism alive on CUDA, then measure it.
# 1. a bare NCCL all-reduce, eager and in a CUDA graph (tp_probe.py); 2. the engine at TP=2 on a
# tiny model, eager then with graphs, with stack dumps if it stops; 3. the GPU TP tests;
# 4. Llama-3-8B shape TP=1 vs TP=2 (bf16 timing, fp32 greedy). Each stage under its own timeout.
set -u
source benchmarks/gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
timeout 60 python3 benchmarks/tp_probe.py > "$OUT/tp_diag.log" 2>&1; echo "probe rc=$?" >> "$OUT/tp_diag.log"
for mode in eager graphs; do
  PAGEDKV_HANG_DUMP_S=50 timeout 75 python3 benchmarks/diag_tp.py $mode >> "$OUT/tp_diag.log" 2>&1
  echo "diag $mode rc=$?" >> "$OUT/tp_diag.log"
done
tail -30 "$OUT/tp_diag.log"
if grep -q "^tp2" "$OUT/tp_diag.log"; then
  timeout 120 python3 -m pytest -q -o addopts="" -x tests/test_tensor_parallel_gpu.py > "$OUT/tp_tests.log" 2>&1
  tail -3 "$OUT/tp_tests.log"
  timeout ${TP_BENCH_S:-300} python3 -m pagedkv bench parallel tp1 tp2 tp-greedy --out "$OUT" > "$OUT/parallel_tp.log" 2>&1
  tail -8 "$OUT/parallel_tp.log"
fi
