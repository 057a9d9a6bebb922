#!/usr/bin/env bash
# One device call: GPU tests and benchmarks, everything under $OUT packed into one tarball
# (the device tool brings back at most 8 files). Usage: bash benchmarks/gpu_session.sh STAGE...
#   tests    GPU-marked tests (kernels at full size in bf16, cache and engine through Triton)
#   kernel   pagedkv bench kernel --validate --variants
#   hf       pagedkv bench hf
#   hflat-tests  GPU tests of the fused decode + K/V write kernel, its bound launches, PagedCache on CUDA
#   hf-latency   pagedkv bench hf --only latency, again with GC frozen, and the host-overhead table
#   engine   pagedkv bench engine
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PAGEDKV_COMMIT=${PAGEDKV_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv | tee "$OUT/r/nvidia_smi.txt"
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    tests)  python3 -m pytest -q -o addopts="" -m gpu tests/test_kernels_gpu.py tests/test_gpu_models.py \
              2>&1 | tee "$OUT/r/gpu_tests.log" | tail -25 ;;
    engine-tests) python3 -m pytest -q -o addopts="" tests/test_gpu_models.py tests/test_fused_kernels.py \
              tests/test_sampler.py tests/test_models.py 2>&1 | tee "$OUT/r/gpu_engine_tests.log" | tail -25 ;;
    profile) python3 benchmarks/profile_engine.py "$OUT/r" 2>&1 | tee "$OUT/r/profile.log" | tail -12 ;;
    models-tests) python3 -m pytest -q -o addopts="" -x tests/test_gpu_models.py tests/test_sampler.py 2>&1 \
              | tee "$OUT/r/gpu_models_tests.log" | tail -15 ;;
    multi) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
            nvidia-smi topo -m > "$OUT/r/topo.txt" 2>&1
            ( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pagedkv bench kernel --validate --no-flex --budget-s 90 \
                --out "$OUT/r" > "$OUT/r/kernel.log" 2>&1 ) &
            CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pagedkv bench parallel tp1 dp1 --out "$OUT/r" 2>&1 | tail -4
            wait
            timeout 120 python3 -m pytest -q -o addopts="" tests/test_tensor_parallel_gpu.py 2>&1 | tail -4
            timeout 300 python3 -m pagedkv bench parallel tp2 dp2 routing --routing-requests 1024 --out "$OUT/r" 2>&1 \
              | tail -6 ;;
    latency) python3 -m pagedkv bench latency --out "$OUT/r" 2>&1 | tee "$OUT/r/latency.log" | tail -40 ;;
    kernel) python3 -m pagedkv bench kernel --validate --variants --out "$OUT/r" 2>&1 | tee "$OUT/r/kernel.log" | tail -60 ;;
    kernel-quick) python3 -m pagedkv bench kernel --validate --out "$OUT/r" 2>&1 | tee "$OUT/r/kernel.log" | tail -60 ;;
    hf)     python3 -m pagedkv bench hf --out "$OUT/r" 2>&1 | tee "$OUT/r/hf.log" | tail -40 ;;
    hflat-tests) python3 -m pytest -q -o addopts="" -m gpu tests/test_kernels_decode_write_gpu.py \
              tests/test_hf_cache_gpu.py 2>&1 | tee "$OUT/r/gpu_hflat_tests.log" | tail -25 ;;
    hf-latency) python3 -m pagedkv bench hf --only latency --out "$OUT/r" 2>&1 | tee "$OUT/r/hf_latency.log" | tail -30
            python3 -m pagedkv bench hf --only latency --gc freeze --no-static --no-diagnose \
              --out "$OUT/r/gc_freeze" 2>&1 | tail -12
            python3 benchmarks/hf_host_overhead.py 2>&1 | tee "$OUT/r/hf_host_overhead.txt" ;;
    engine) python3 -m pagedkv bench engine --hf-time-limit 60 --out "$OUT/r" 2>&1 | tee "$OUT/r/engine.log" | tail -30 ;;
    engine-nohf) python3 -m pagedkv bench engine --skip-hf --out "$OUT/r" 2>&1 | tee "$OUT/r/engine.log" | tail -30 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== stage $stage took $(( $(date +%s) - start )) s"
done
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$OUT/r"
