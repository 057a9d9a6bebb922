#!/usr/bin/env bash
# pagedkv beside FlashInfer on the GPU machine: decode (tensor-core and CUDA-core), prefill (fa2, fa3) and
# FP8 decode on the same paged pool, each checked against float64 first, then timed as `pagedkv bench kernel`
# times (do_bench of a one-call CUDA graph, L2 flushed). FlashInfer is carried as wheels (no network there):
#
#   echo /.whl-fi/ >> .git/info/exclude   # once, here
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl-fi flashinfer-python==0.7.0.post1 apache-tvm-ffi==0.1.15.post2     # 34 + 3 MB
#   then run with `carry: [".whl-fi"]`:  bash benchmarks/tools/flashinfer_anchor.sh
#
# FlashInfer compiles its kernels on first use (nvcc there: about 45 s for decode and FA2 modules, 100 s for
# FA3, more for the FP8 variants); flashinfer_prewarm.py builds them side by side first, then the timing
# takes about 1 minute.
# Prints the table "pagedkv beside FlashInfer" and writes kernel_flashinfer.json under $OUT.
set -euo pipefail
OUT=${OUT:-/tmp/flashinfer_anchor}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if compgen -G ".whl-fi/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-fi/*.whl
  export PYTHONPATH=/tmp/site:src PATH=/tmp/site/bin:$PATH
fi
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" \
  || echo "flashinfer does not import: the section will say so and time nothing"
# Compile FlashInfer's modules side by side first (one process per kind), then time.
start=$SECONDS
for kind in decode-tc decode-cc fa2 fa3 fp8-tc fp8-cc; do
  python3 benchmarks/tools/flashinfer_prewarm.py "$kind" > "/tmp/prewarm_$kind.log" 2>&1 &
done
wait
cat /tmp/prewarm_*.log | grep -v "^\s*$" | tail -n 30
echo "prewarm: $((SECONDS - start)) s"
python3 -m pagedkv bench kernel --flashinfer-only --out "$OUT" 2>&1 | tee "$OUT/flashinfer_anchor.log"
