# Sourced by the GPU call scripts: run from source, unbuffered, NVLink multicast off (PERF-NOTES),
# the commit the results name (`.commit`, carried to the device), and $OUT.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PAGEDKV_COMMIT=${PAGEDKV_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
