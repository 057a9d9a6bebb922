#!/usr/bin/env bash
# Session 5, one GPU (~3 minutes): Nsight Compute on bf16 and FP8 decode at B=64 x 4096 (where FP8's time goes).
set -u
source benchmarks/gpu_env.sh
start_log /tmp/r5c
say "ncu"
timeout 400 ncu --profile-from-start off --set full --kernel-name regex:"_decode_kernel|_tiles_decode_kernel" \
  -o "$R/fp8_decode" python3 benchmarks/profile_fp8_decode.py > "$R/ncu.log" 2>&1
tail -5 "$R/ncu.log" >> "$R/summary.log"
ncu --import "$R/fp8_decode.ncu-rep" --print-summary none --page details > "$R/fp8_decode_details.txt" 2>&1
grep -E "^  [a-z_]+|Duration|Memory Throughput|Compute \(SM\)|Issue Slots Busy|Executed Ipc A|No Eligible|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|pipe|Pipe" \
  "$R/fp8_decode_details.txt" | cut -c1-160 | head -150 >> "$R/summary.log"
ncu --import "$R/fp8_decode.ncu-rep" --print-summary none --page raw --csv \
  --metrics smsp__average_warp_latency_issue_stalled_short_scoreboard,smsp__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fp16.avg.pct_of_peak_sustained_active \
  > "$R/pipes.csv" 2>&1
cat "$R/pipes.csv" | cut -c1-400 >> "$R/summary.log"
finish_log
