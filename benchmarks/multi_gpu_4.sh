#!/usr/bin/env bash
# Two-GPU call (nvidia-h200-x2), part B, after the teardown fix: the probe and the GPU TP tests must
# now exit; then TP=2 and the fp32 greedy check on the Llama-3-8B shape; then data parallel and routing.
set -u
source benchmarks/gpu_env.sh
timeout 45 python3 benchmarks/tp_probe.py > "$OUT/tp_probe.log" 2>&1; echo "probe rc=$?" >> "$OUT/tp_probe.log"
tail -4 "$OUT/tp_probe.log"
timeout 150 python3 -m pytest -q -o addopts="" -x tests/test_tensor_parallel_gpu.py > "$OUT/tp_tests.log" 2>&1
tail -3 "$OUT/tp_tests.log"
timeout 210 python3 -m pagedkv bench parallel tp2 tp-greedy --out "$OUT" > "$OUT/parallel.log" 2>&1
tail -3 "$OUT/parallel.log"
timeout 170 python3 -m pagedkv bench parallel dp1 dp2 routing --out "$OUT" >> "$OUT/parallel.log" 2>&1
tail -4 "$OUT/parallel.log"
