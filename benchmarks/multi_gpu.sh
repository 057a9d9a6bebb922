#!/usr/bin/env bash
# One call on the two-GPU machine (nvidia-h200-x2). Files go straight to $OUT (at most 8), so a
# call cut short still returns what finished. GPU 1 runs the kernel benchmark while GPU 0 runs
# the one-GPU baselines; then both GPUs run tensor parallel, data parallel and routing.
set -u
source benchmarks/gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
( CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pagedkv bench kernel --validate --no-flex --budget-s 60 \
    --out "$OUT" > "$OUT/kernel.log" 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pagedkv bench parallel tp1 dp1 --out "$OUT" > "$OUT/parallel.log" 2>&1
wait
timeout 80 python3 -m pytest -q -o addopts="" -x tests/test_tensor_parallel_gpu.py > "$OUT/tp_tests.log" 2>&1
tail -3 "$OUT/tp_tests.log"
timeout 200 python3 -m pagedkv bench parallel tp2 dp2 routing --routing-requests 512 --out "$OUT" >> "$OUT/parallel.log" 2>&1
tail -12 "$OUT/parallel.log"; tail -25 "$OUT/kernel.log"
