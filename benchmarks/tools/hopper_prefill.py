"""Split prefill on Hopper: every variant checked against float64, then timed beside today's paged prefill kernel.

    PYTHONPATH=src python3 benchmarks/tools/hopper_prefill.py --out $OUT [--variants a,b] [--pages 16,64,128]

`--variants` defaults to DEFAULT_VARIANTS: the shipped launch ("auto"), the two tile shapes it
picks from, the chunk's 2-way split, and each of them with the GQA-packed program (`packed`:
one program per kv head holds its 4 query heads' rows, so a K/V tile is read once per group).

Cases (Llama-3-8B attention, 32 q / 8 kv heads, head_dim 128, bf16):
    prefill 8 x 2048 causal          eight fresh prompts (no prefix: the split kernel reads no page)
    chunk 512 on a 4,096 prefix      one chunk; 4,096 keys through pages, 512 contiguous
at each page size of `--pages` (the prefill case at page 16 only: it reads no page).

Compiling a Triton variant takes seconds, and the device time is short, so the float64 checks
(which also compile every kernel at every timed specialization) run in parallel worker
processes, one per variant; the parent then times one contender at a time with the bench's
method (do_bench median of a one-call CUDA graph, L2 flushed) and hits Triton's cache.
A variant that fails its check is reported and not timed. Prints a table; writes
hopper_prefill.json (and the workers' check logs) under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedkv.bench.kernel_common import shuffled_layout

SMOKE = os.environ.get("HOPPER_PREFILL_SMOKE") == "1"  # CPU, the Triton interpreter, fp16, tiny shapes
DEVICE, DTYPE = ("cpu", torch.float16) if SMOKE else ("cuda", torch.bfloat16)
H, HKV, D = (4, 2, 64) if SMOKE else (32, 8, 128)
if SMOKE:  # the tests' interpreter fix for NumPy >= 2.4 (runtime loop bounds)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    __import__("conftest")
#: name -> SplitPrefillTuning fields.
#: H200 sweeps at 03feb2d and 29af838 (results/hopper_prefill_b947abe/): 128 x 64 tiles, 2 stages, 128 registers
#: ("wide": two programs per SM) led 8 x 2048 causal at 404 TFLOP/s; 128 x 128 tiles, 3 stages ("deep": one per
#: SM) led the chunk at 335-361. warp_specialize=True, 4 warps, 256-row tiles and 32-token kv tiles trailed.
#: This run: the shipped default ("auto") and the chunk's kv range split 2-4 ways so that it fills two per SM.
WIDE = dict(block_m=128, block_n=64, num_warps=8, num_stages=2, maxnreg=128)
DEEP = dict(block_m=128, block_n=128, num_warps=8, num_stages=3, maxnreg=0)
VARIANTS = {
    "auto": {},
    "wide": dict(WIDE, num_splits=1),
    "deep": dict(DEEP, num_splits=1),
    "wide split2": dict(WIDE, num_splits=2),
    "wide split3": dict(WIDE, num_splits=3),
    "wide split4": dict(WIDE, num_splits=4),
    "deep split2": dict(DEEP, num_splits=2),
    "m64 n64 w4 s2 split2": dict(block_m=64, block_n=64, num_warps=4, num_stages=2, maxnreg=0, num_splits=2),
}
#: GQA-packed (SplitPrefillTuning.pack_gqa): 128 rows = 32 tokens x 4 heads, so the same program counts as above.
PACKED = ("auto", "wide", "deep", "wide split2", "deep split2")
VARIANTS.update({f"{name} packed": dict(VARIANTS[name], pack_gqa=True) for name in PACKED})
VARIANTS["wide packed nocap"] = dict(WIDE, maxnreg=0, num_splits=1, pack_gqa=True)  # the packed rows spill at 128
#: The Gluon kernel (`kernels.gluon_prefill`: a TMA producer and two wgmma consumer warp groups, persistent).
GLUON = "gluon"
VARIANTS[GLUON] = {}
DEFAULT_VARIANTS = ("auto", "wide", "deep", "wide split2", "deep split2", *(f"{name} packed" for name in PACKED),
                    "wide packed nocap")
#: name -> (batch, chunk tokens, cached prefix tokens)
CASES = {"prefill 8 x 2048": (8, 2048, 0), "chunk 512 on 4096": (1, 512, 4096),
         "chunk 64 on 16384": (1, 64, 16384)}  # 32 items for 132 SMs: the default route keeps the split kernel
#: A ragged mix for the checks: whole prompts, chunks on prefixes (ragged ones), a one-token chunk.
MIXED = ([1000, 4608, 2048, 129, 17, 300, 77], [1000, 512, 2048, 64, 17, 1, 40])
if SMOKE:
    VARIANTS = {"m32 n16": dict(block_m=32, block_n=16, num_warps=4, num_stages=2),
                "m32 n16 split3": dict(block_m=32, block_n=16, num_warps=4, num_stages=2, num_splits=3)}
    VARIANTS.update({f"{name} packed": dict(VARIANTS[name], pack_gqa=True) for name in list(VARIANTS)})
    DEFAULT_VARIANTS = tuple(VARIANTS)
    CASES = {"prefill 2 x 64": (2, 64, 0), "chunk 32 on 64": (1, 32, 64)}
    MIXED = ([40, 70, 5], [40, 30, 1])


def flops(batch: int, chunk: int, prefix: int) -> float:
    return batch * 2 * 2 * H * D * (chunk * prefix + chunk * (chunk + 1) / 2)


def make_step(seq_lens, q_lens, page, seed, poison=True, heads=None):
    """A pool (NaN where nobody wrote) behind shuffled tables, and a QKV whose K/V rows were written to it."""
    from pagedkv.kernels import write_kv

    nh, nkv, dim = heads or (H, HKV, D)

    gen = torch.Generator().manual_seed(seed)
    num_blocks, table, slots = shuffled_layout(seq_lens, page, gen, extra_blocks=8, device=DEVICE)
    fill = float("nan") if poison else 0.0
    k_cache = torch.full((num_blocks, page, nkv, dim), fill, dtype=DTYPE, device=DEVICE)
    v_cache = torch.full_like(k_cache, fill)
    total = sum(seq_lens)
    keys = torch.randn(total, nkv, dim, generator=gen).to(DEVICE, DTYPE)
    values = torch.randn(total, nkv, dim, generator=gen).to(DEVICE, DTYPE)
    write_kv(keys, values, k_cache, v_cache, slots)
    num_tokens = sum(q_lens)
    qkv = torch.randn(num_tokens, (nh + 2 * nkv) * dim, generator=gen).to(DEVICE, DTYPE)
    q = qkv[:, :nh * dim].view(num_tokens, nh, dim)
    k = qkv[:, nh * dim:(nh + nkv) * dim].view(num_tokens, nkv, dim)
    v = qkv[:, (nh + nkv) * dim:].view(num_tokens, nkv, dim)
    offset = row = 0
    for n, ql in zip(seq_lens, q_lens):  # the chunk's K/V rows are what the pool holds for its positions
        k[row:row + ql] = keys[offset + n - ql:offset + n]
        v[row:row + ql] = values[offset + n - ql:offset + n]
        offset, row = offset + n, row + ql
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return dict(query=q, key=k, value=v, k_cache=k_cache, v_cache=v_cache, table=table,
                lens=lens, cu=cu, max_q=max(q_lens), max_seq_len=max(seq_lens), scale=dim ** -0.5)


def case_step(case: str, page: int, poison: bool):
    batch, chunk, prefix = CASES[case]
    return make_step([prefix + chunk] * batch, [chunk] * batch, page, seed=7, poison=poison)


def split_call(step, variant):
    from pagedkv.kernels.triton_prefill_split import triton_split_prefill_attention, unsupported_reason
    from pagedkv.kernels.tuning import SplitPrefillTuning

    out = torch.empty_like(step["query"])
    reason = unsupported_reason(step["query"], step["key"], step["value"], step["k_cache"], step["v_cache"], out,
                                sliding_window=None, soft_cap=None, k_scale=None)
    if reason:
        raise RuntimeError(reason)
    if variant == GLUON:
        from pagedkv.kernels import gluon_prefill

        reason = gluon_prefill.unsupported_reason(step["query"], step["k_cache"])
        if reason:
            raise RuntimeError(reason)
        return functools.partial(gluon_prefill.gluon_prefill_attention, step["query"], step["key"], step["value"],
                                 step["k_cache"], step["v_cache"], step["table"], step["lens"], step["cu"], out,
                                 scale=step["scale"], max_seqlen_q=step["max_q"])
    return functools.partial(triton_split_prefill_attention, step["query"], step["key"], step["value"],
                             step["k_cache"], step["v_cache"], step["table"], step["lens"], step["cu"], out,
                             scale=step["scale"], max_seqlen_q=step["max_q"], max_seq_len=step["max_seq_len"],
                             tuning=SplitPrefillTuning(**VARIANTS[variant]))


def paged_call(step):
    from pagedkv.kernels import paged_prefill_attention

    out = torch.empty_like(step["query"])
    return functools.partial(paged_prefill_attention, step["query"], step["k_cache"], step["v_cache"], step["table"],
                             step["lens"], step["cu"], scale=step["scale"], max_seqlen_q=step["max_q"], out=out,
                             validate=False, backend="triton", max_seq_len=step["max_seq_len"])


def check(call, step, expected) -> dict:
    from pagedkv.bench.kernel_common import max_abs_err

    try:
        out = call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - reported, never raised
        return {"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    err = max_abs_err(out, expected)
    close = bool(torch.isclose(out.double(), expected, atol=1.5e-2, rtol=1.6e-2).all())
    return {"ok": close, "max_abs_err": err, "error": "" if close else f"max abs err {err:.3g}"}


def reference(step):
    from pagedkv.kernels import reference_prefill_attention

    return reference_prefill_attention(step["query"], step["k_cache"], step["v_cache"], step["table"], step["lens"],
                                       step["cu"], scale=step["scale"], float64=True)


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every split-prefill kernel this process compiled."""
    from pagedkv.kernels import triton_prefill_packed, triton_prefill_split

    jits = [triton_prefill_split._split_prefill_kernel, triton_prefill_packed._packed_prefill_kernel]
    if not SMOKE:
        from pagedkv.kernels import gluon_prefill

        jits.append(gluon_prefill._gluon_prefill_kernel)
    rows = []
    for jit in jits:
        for cache in getattr(jit, "device_caches", {}).values():
            for kernel in cache[0].values():
                meta = kernel.metadata
                rows.append({"kernel": meta.name, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                             "shared": meta.shared, "n_regs": getattr(kernel, "n_regs", None),
                             "n_spills": getattr(kernel, "n_spills", None)})
    return rows


def worker(variants: list[str], pages: list[int], work: Path, index: int) -> None:
    """Check each variant (and, in worker 0, the paged kernel) on the mixed step and every timed case."""
    steps = {("mixed", p): make_step(*MIXED, p, seed=11) for p in (16, pages[-1])}
    if not SMOKE:  # other engine heads (Qwen3-0.6B; SmolLM2-135M's head_dim 64) on the mixed step
        steps.update({(f"mixed heads {h}", p): make_step(*MIXED, p, seed=12, heads=h)
                      for h in ((16, 8, 128), (9, 3, 64)) for p in (16, 64)})
    steps.update({(c, p): case_step(c, p, poison=True) for c in CASES for p in (pages if c.startswith("chunk")
                                                                                 else [16])})
    rows = []
    for key, step in steps.items():
        expected = reference(step)
        names = list(variants) + (["paged"] if index == 0 else [])
        for name in names:
            start = time.perf_counter()
            result = check(paged_call(step) if name == "paged" else split_call(step, name), step, expected)
            rows.append({"variant": name, "case": key[0], "page": key[1], "s": round(time.perf_counter() - start, 1),
                         **result})
            print(json.dumps(rows[-1]), flush=True)
        del expected
    rows.append({"variant": variants[0], "case": "resources", "page": 0, "ok": True, "error": "",
                 "kernels": compiled_resources()})
    print(json.dumps(rows[-1]), flush=True)
    (work / f"checks_{index}.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/hopper_prefill")))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of: {', '.join(VARIANTS)}")
    parser.add_argument("--pages", default="16,64,128")
    parser.add_argument("--worker", type=int, default=None)
    parser.add_argument("--work", type=Path, default=None, help="(internal) the workers' scratch folder")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    pages = [int(p) for p in args.pages.split(",")]
    if args.worker is not None:
        worker(variants, pages, args.work, args.worker)
        return
    work = Path(tempfile.mkdtemp(prefix="hopper_prefill_"))  # $OUT brings back 8 files at most

    from pagedkv.bench.kernel_common import sdpa_flash_causal, try_time_graphed

    start = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--out", str(args.out), "--variants", name, "--pages",
                               args.pages, "--worker", str(i), "--work", str(work)],
                              stdout=open(work / f"worker_{i}.log", "w"), stderr=subprocess.STDOUT)
             for i, name in enumerate(variants)]
    for proc in procs:  # a variant that hangs (a warp-specialized deadlock, say) must not take the run with it
        try:
            proc.wait(timeout=max(1.0, 180 - (time.time() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
    with open(args.out / "workers.log", "w") as log:
        for i in range(len(variants)):
            log.write(f"--- worker {i}: {variants[i]}\n" + (work / f"worker_{i}.log").read_text())
    checks = [row for i in range(len(variants)) if (work / f"checks_{i}.json").exists()
              for row in json.loads((work / f"checks_{i}.json").read_text())]
    failed = {row["variant"] for row in checks if not row["ok"]}
    passed = {row["variant"] for row in checks} - failed  # a worker killed at its timeout left no rows: untimed
    missing = [variants[i] for i in range(len(variants)) if not (work / f"checks_{i}.json").exists()]
    for row in checks:
        if row["case"] == "resources":
            print(f"  {row['variant']:22s} " + "; ".join(
                f"{k['kernel'].strip('_').split('_')[0]} regs {k['n_regs']} spills {k['n_spills']} "
                f"smem {k['shared'] // 1024} KiB" for k in row["kernels"]))
    print(f"checks: {len(checks)} rows in {time.time() - start:.0f} s; failed: {sorted(failed) or 'none'}; "
          f"workers without results: {missing or 'none'}", flush=True)
    for row in checks:
        if not row["ok"]:
            print(f"  FAILED {row['variant']} {row['case']} page {row['page']}: {row['error']}")

    device = torch.device(DEVICE)
    results = []
    for case, (batch, chunk, prefix) in CASES.items():
        for page in (pages if prefix else [16]):
            step = case_step(case, page, poison=False)
            work = flops(batch, chunk, prefix)
            contenders = {"paged (today)": paged_call(step)}
            contenders.update({name: split_call(step, name) for name in variants if name in passed})
            if not prefix:
                q = step["query"].view(batch, chunk, H, D).transpose(1, 2)
                k = step["key"].view(batch, chunk, HKV, D).transpose(1, 2).contiguous()
                v = step["value"].view(batch, chunk, HKV, D).transpose(1, 2).contiguous()
                sdpa, sdpa_backend = sdpa_flash_causal(q, k, v)
                contenders["sdpa " + sdpa_backend] = sdpa
            for name, call in contenders.items():
                ms, error = try_time_graphed(call, device)
                row = {"case": case, "page": page, "contender": name, "ms": ms, "error": error,
                       "tflops": work / (ms * 1e-3) / 1e12 if ms else None}
                results.append(row)
                print(f"{case:20s} page {page:3d}  {name:22s} "
                      + (f"{row['tflops']:6.1f} TFLOP/s  {ms * 1e3:8.1f} us" if ms else f"failed: {error}"),
                      flush=True)
            del step
    meta = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke)",
            "torch": torch.__version__,
            "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("PAGEDKV_COMMIT", "")}
    (args.out / "hopper_prefill.json").write_text(json.dumps({"meta": meta, "checks": checks, "timings": results},
                                                             indent=1))
    print("\nbest per case and page:")
    for case in CASES:
        for page in sorted({r["page"] for r in results if r["case"] == case}):
            rows = [r for r in results if r["case"] == case and r["page"] == page and r["tflops"]]
            best = max(rows, key=lambda r: r["tflops"], default=None)
            today = next((r for r in rows if r["contender"] == "paged (today)"), None)
            if best:
                print(f"  {case:20s} page {page:3d}: best {best['contender']} {best['tflops']:.1f} TFLOP/s; "
                      f"today {today['tflops'] if today else float('nan'):.1f}")
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
