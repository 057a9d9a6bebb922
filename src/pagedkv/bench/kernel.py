"""`pagedkv bench kernel`: paged decode/prefill kernels against the memory roofline and SDPA.

Decode is memory bound, so the figure of merit is achieved bandwidth: bytes of K/V read
over time, against the device's measured copy bandwidth (a large device-to-device copy,
bytes read + written over time). In the same run it times torch's contiguous SDPA on the
same data (what paging must not lose to), gather + SDPA (the naive paged approach) and,
where it runs, FlexAttention's paged attention. Prefill is compute bound: TFLOP/s of causal
attention, 2 * 2 * H * D * L^2 / 2 per sequence.

Every pagedkv contender is validated before it is timed: the named kernels and decode
schedules against the float64 reference first (`--validate`, always on in a GPU run),
then each grid case's schedules against the default schedule's output, and each step case
(`kernel_steps`: engine shapes, chunked prefill, a mixed step) against the reference on its
own data. A contender that fails is reported and not timed.

Order of work: validation, the FP8 decode cases when `--kv-dtype` names an FP8 format
(`kernel_fp8`: FP8 against bf16 caches in the same run; `--fp8-only` stops there), the decode
grid (old and new decode schedules side by side), write_kv, prefill, the step cases, FlashInfer
beside pagedkv when `flashinfer` imports (`kernel_flashinfer`: decode, prefill and FP8 decode on
the same pool; without it one line says so), then `--variants` (launch configurations side by
side, skipped past `--budget-s`). Timings are
medians of CUDA-graph replays under `triton.testing.do_bench`, which flushes L2 before every
call. It never asserts: each target is printed as met or MISSED with its measured figure, and
recorded in the JSON. Shared shapes, data and timing live in `bench.kernel_common`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pagedkv.bench.kernel_common import NUM_KV_HEADS, copy_bandwidth_tbps, fmt, unified_variant_tunings
from pagedkv.bench.kernel_decode import GRID, SMOKE_GRID, decode_grid
from pagedkv.bench.kernel_decode import table_rows as decode_table_rows
from pagedkv.bench.kernel_prefill import prefill_throughput, write_kv_bandwidth
from pagedkv.bench.kernel_report import print_table, target_summary, verdict, write_markdown
from pagedkv.bench.kernel_validate import failed_contenders, validate
from pagedkv.bench.kernel_variants import decode_variant_tunings, prefill_variant_tunings, variants
from pagedkv.cli import ArgumentParser
from pagedkv.results import add_out_argument


def main(argv: list[str] | None = None, prog: str = "pagedkv bench kernel") -> int:
    """Validate, time and report the paged kernels; writes `<out>/kernel.json` and `<out>/kernel.md`."""
    parser = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_out_argument(parser, "kernel.json and kernel.md")
    parser.add_argument("--validate", action="store_true",
                        help="check every contender vs the reference first (always on for a GPU run)")
    parser.add_argument("--variants", action="store_true", help="also time alternative launch configurations")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes ~30 s)")
    parser.add_argument("--no-flashinfer", action="store_true",
                        help="skip the FlashInfer anchor section (run when flashinfer imports; never required)")
    parser.add_argument("--flashinfer-only", action="store_true",
                        help="run the FlashInfer anchor section alone (pagedkv beside FlashInfer: decode, prefill, "
                             "FP8 decode) and write kernel_flashinfer.json")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="variants still waiting after this many seconds of the run are skipped")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8_e4m3", "fp8_e5m2"),
                        help="also time decode on an FP8 cache against the model-dtype one (B=64x4096, B=1x32768)")
    parser.add_argument("--fp8-only", action="store_true",
                        help="with --kv-dtype: run validation and the FP8 cases only")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU (checks the script, not the GPU): the torch path, or the Triton "
                             "kernels under the interpreter when TRITON_INTERPRET=1 is set")
    args = parser.parse_args(argv)

    import os

    import torch
    from rich.console import Console

    from pagedkv.bench import kernel_steps
    from pagedkv.bench.common import GPURequiredError
    from pagedkv.results import provenance, write_json

    console = Console(width=240)  # logs of a remote run are not a terminal: keep rows on one line
    if torch.cuda.is_available():
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, "triton"
        device_name = torch.cuda.get_device_name(device)
    elif args.smoke:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        device, dtype, backend = torch.device("cpu"), torch.float32, "triton" if interpret else "torch"
        device_name = f"cpu (smoke: {'Triton interpreter' if interpret else 'torch path'})"
    else:
        raise GPURequiredError("pagedkv bench kernel needs a CUDA GPU, and torch.cuda.is_available() is False; "
                               "--smoke exercises the script on CPU")
    started = time.perf_counter()

    def progress(message: str) -> None:
        console.print(f"[{time.perf_counter() - started:6.1f} s] {message}")

    result: dict = {"benchmark": "kernel", "dtype": str(dtype).removeprefix("torch."), "backend": backend}
    result["provenance"] = provenance(device=device_name)
    smoke = args.smoke or device.type != "cuda"

    if args.flashinfer_only:
        from pagedkv.bench import kernel_flashinfer

        result["flashinfer"] = kernel_flashinfer.anchor(device, dtype, backend, smoke, progress)
        if result["flashinfer"]["rows"]:
            print_table(console, f"pagedkv beside FlashInfer {result['flashinfer']['version']}",
                         *kernel_flashinfer.table_rows(result["flashinfer"]))
        console.print(f"wrote {write_json(args.out, 'kernel_flashinfer', result)}")
        return 0

    invalid: set = set()
    if args.validate or not smoke or backend == "triton":
        result["validation"] = validate(device, dtype, backend, decode_variant_tunings(),
                                        prefill_variant_tunings(), unified_variant_tunings())
        invalid = failed_contenders(result["validation"])
        for row in result["validation"]:
            console.print(f"validate {row['kernel']:<8} {row['contender']:<32} {row['case']:<44} max abs err "
                          f"{row['max_abs_err']:.2e} (tol {row['tolerance']:.0e}): {'ok' if row['ok'] else 'FAILED'} "
                          f"{row['error']}")
        progress(f"validation: {len(result['validation'])} checks, {len(invalid)} contenders failed")

    result["copy_tbps"] = copy_bandwidth_tbps(device, 2 * 2**30 if device.type == "cuda" else 2**26)
    progress(f"copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s")
    if args.kv_dtype != "auto":
        from pagedkv.bench import kernel_fp8
        from pagedkv.kernels import KernelWorkspace

        result["fp8_decode"] = kernel_fp8.fp8_decode(device, dtype, backend, args.kv_dtype, result["copy_tbps"], smoke,
                                                     KernelWorkspace(64 * NUM_KV_HEADS, device), progress)
        print_table(console, f"Paged decode, {args.kv_dtype} against {result['dtype']} caches, {device_name}",
                     *kernel_fp8.table_rows(result["fp8_decode"]))
        result["fp8_targets"] = kernel_fp8.target_rows(result["fp8_decode"])
        if args.fp8_only:
            result["target_summary"] = result["fp8_targets"]
            print_table(console, "Targets", ["target", "measured", "met"],
                         [[t["target"], t["measured"], verdict(t["met"])] for t in result["target_summary"]])
            result["elapsed_s"] = time.perf_counter() - started
            console.print(f"wrote {write_json(args.out, 'kernel_fp8', result)} in {result['elapsed_s']:.0f} s")
            return 0
    result["decode"] = decode_grid(device, dtype, backend, GRID if not smoke else SMOKE_GRID, result["copy_tbps"],
                                   not args.no_flex and device.type == "cuda", invalid, progress)
    print_table(console, f"Paged decode, Llama-3-8B attention, {result['dtype']} on {device_name}",
                 *decode_table_rows(result["decode"]))

    result["write_kv"] = write_kv_bandwidth(device, dtype, backend, 16384 if not smoke else 256)
    prefill_shape = (8, 2048) if not smoke else (1, 64)
    result["prefill"] = prefill_throughput(device, dtype, backend, *prefill_shape)
    unified_prefill = prefill_throughput(device, dtype, backend, *prefill_shape, kernel="unified", with_sdpa=False)
    split_prefill = prefill_throughput(device, dtype, backend, *prefill_shape, kernel="split", with_sdpa=False)
    result["prefill_contenders"] = [{**result["prefill"], "label": "prefill kernel"},
                                    {**unified_prefill, "label": "unified kernel"},
                                    {**split_prefill, "label": "split kernel (engine)"}]
    w, p = result["write_kv"], result["prefill"]
    progress(f"write_kv {w['num_tokens']} tokens: {fmt(w['tbps'])} TB/s (read + write) {w['error']}")
    progress(f"prefill {p['batch']} x {p['seq_len']} causal: {fmt(p['tflops'], '.1f')} TFLOP/s (unified kernel "
             f"{fmt(unified_prefill['tflops'], '.1f')}, split kernel {fmt(split_prefill['tflops'], '.1f')}); "
             f"contiguous causal SDPA ({p['sdpa_backend']}) "
             f"{fmt(p['sdpa_causal_tflops'], '.1f')} TFLOP/s {p['error']}")

    result["steps"], result["step_targets"] = kernel_steps.run_steps(device, dtype, backend, smoke,
                                                                     result["copy_tbps"], invalid, progress)
    for title, section in result["steps"].items():
        print_table(console, f"{title}: {section['note']}", section["header"], section["body"])

    if not args.no_flashinfer:
        from pagedkv.bench import kernel_flashinfer

        result["flashinfer"] = kernel_flashinfer.anchor(device, dtype, backend, smoke, progress)
        if result["flashinfer"]["rows"]:
            print_table(console, f"pagedkv beside FlashInfer {result['flashinfer']['version']} (same pool, "
                                  f"same method)", *kernel_flashinfer.table_rows(result["flashinfer"]))

    if args.variants:
        result["variants"] = variants(device, dtype, backend, smoke, started + args.budget_s, invalid, progress)
        rows = result["variants"]["decode"]
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        best = {s: max((r["tbps"] or 0) for r in rows if r["shape"] == s) for s in shapes}
        by_variant: dict[str, dict[str, dict]] = {}
        for r in rows:
            by_variant.setdefault(r["variant"], {})[r["shape"]] = r
        print_table(console, "Decode variants (TB/s, CUDA-graph replays; best per shape marked *)",
                     ["variant", *shapes],
                     [[name, *[fmt(cells[s]["tbps"], ".2f", (cells[s]["error"] or "n/a")[:30])
                               + ("*" if cells[s]["tbps"] and cells[s]["tbps"] == best[s] else "") for s in shapes]]
                      for name, cells in by_variant.items()])
        print_table(console, f"Prefill variants, {prefill_shape[0]} x {prefill_shape[1]} causal",
                     ["variant", "kernel", "TFLOP/s"],
                     [[r["variant"], r.get("kernel", "prefill"), fmt(r["tflops"], ".1f", (r["error"] or "n/a")[:40])]
                      for r in result["variants"]["prefill"]])
        result["prefill_contenders"] += [{**r, "label": r["variant"] if r["variant"].startswith(r["kernel"])
                                          else f"{r['kernel']} {r['variant']}"}
                                         for r in result["variants"]["prefill"] if r.get("tflops")]

    result["target_summary"] = target_summary(result)
    print_table(console, "Targets", ["target", "measured", "met"],
                 [[t["target"], t["measured"], verdict(t["met"])] for t in result["target_summary"]])
    result["elapsed_s"] = time.perf_counter() - started
    console.print(f"wrote {write_json(args.out, 'kernel', result)} and {write_markdown(Path(args.out), result)} "
                  f"in {result['elapsed_s']:.0f} s")
    return 0
