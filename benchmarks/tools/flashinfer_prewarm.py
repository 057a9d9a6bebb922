"""Build FlashInfer's JIT modules for `bench kernel --flashinfer-only` in parallel, before the bench runs.

FlashInfer compiles a module on its first call (decode, FA2, FA3, FP8 decode: one each), one
after another when the bench meets them: 6-9 minutes on the H200 machine. A module is keyed by
dtypes, head_dim and options, not by batch or length, so one tiny call of each kind builds what
the bench's real cases load. Run one process per kind side by side:

    for k in decode-tc decode-cc fa2 fa3 fp8-tc fp8-cc; do python3 flashinfer_prewarm.py $k & done; wait
"""

from __future__ import annotations

import sys
import time

import torch

from pagedkv.bench.kernel_common import HEAD_DIM, make_paged
from pagedkv.bench.kernel_flashinfer import (
    PAGE,
    _quantize_one_scale,
    flashinfer_decode,
    flashinfer_prefill,
    import_flashinfer,
)

KINDS = ("decode-tc", "decode-cc", "fa2", "fa3", "fp8-tc", "fp8-cc")


def build(kind: str) -> None:
    """One small call of `kind`, so that its module is compiled and cached."""
    fi, why = import_flashinfer()
    if fi is None:
        print(f"prewarm {kind}: FlashInfer does not import ({why})")
        return
    device, dtype, scale = torch.device("cuda"), torch.bfloat16, HEAD_DIM ** -0.5
    query, k_cache, v_cache, table, lens = make_paged(2, 64, PAGE, True, device, dtype, seed=1)
    if kind in ("decode-tc", "decode-cc"):
        call = flashinfer_decode(fi, query, k_cache, v_cache, table, lens, scale, kind == "decode-tc")
    elif kind in ("fp8-tc", "fp8-cc"):
        k8, v8, _, _, k_scale, v_scale = _quantize_one_scale(k_cache, v_cache)
        call = flashinfer_decode(fi, query, k8, v8, table, lens, scale, kind == "fp8-tc", k_scale, v_scale)
    else:
        chunk = 16
        query = torch.randn(2 * chunk, query.shape[1], HEAD_DIM, dtype=dtype, device=device)
        cu = torch.arange(0, 2 * chunk + 1, chunk, dtype=torch.int32, device=device)
        call = flashinfer_prefill(fi, query, k_cache, v_cache, table, lens, cu, scale, kind)
    call()
    torch.cuda.synchronize()


def main() -> None:
    for kind in sys.argv[1:] or KINDS:
        start = time.perf_counter()
        try:
            build(kind)
            print(f"prewarm {kind}: built in {time.perf_counter() - start:.0f} s", flush=True)
        except Exception as error:  # noqa: BLE001 - the bench itself reports the failure on its case
            print(f"prewarm {kind}: failed after {time.perf_counter() - start:.0f} s: {error!r}"[:400], flush=True)


if __name__ == "__main__":
    main()
