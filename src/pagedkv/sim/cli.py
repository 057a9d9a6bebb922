"""`pagedkv sim`: the deterministic serving simulator's command line (argparse over `sim.sweep`).

    pagedkv sim                         naive vs paged at --watermark (PageFault's stage 4)
    pagedkv sim --sweep                 watermarks 0-50% x victim policies x preemption modes;
                                        writes <out>/sim_sweep.json and <out>/sim_sweep.png
                                        (--quick: a small sweep that checks the command in seconds)
    pagedkv sim --fidelity RUN.json     predict a measured engine run's throughput
    pagedkv sim --cluster               replicas behind the data-parallel router (see sim.cluster_cli)
    pagedkv sim --model gemma3-12b      adds a run with a block table per layer group (sliding-window
                                        layers keep only their window), in the same memory
    pagedkv sim --chat-tiers            multi-turn chat: TTFT against host-tier size (see sim.chat_tiers_cli)
    pagedkv sim --kv-cache-dtype fp8_e4m3
                                        the same memory as --blocks bf16 blocks holds twice the FP8
                                        blocks, and the cost model's KV-read and swap terms halve

Standard output depends only on the arguments and the cost model, never on the machine or
the clock (wall time and provenance go to the JSON files only). Bad input raises
`InvalidArgumentError` / `ConfigError` (argparse's own errors too), which `pagedkv.cli`
prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from pagedkv.cli import ArgumentParser
from pagedkv.core.memory import KV_CACHE_DTYPES, kv_cache_dtype_bytes
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import InvalidArgumentError, RequestRejectedError, require_positive_int
from pagedkv.results import add_out_argument
from pagedkv.sim.chat_tiers_cli import add_chat_tiers_arguments, run_chat_tiers
from pagedkv.sim.cluster_cli import add_cluster_arguments, run_cluster
from pagedkv.sim.cost_model import CostModel, resolve_cost_model
from pagedkv.sim.fidelity import TARGET_RELATIVE_ERROR, load_engine_run, predict
from pagedkv.sim.sweep import (
    ALL_PREEMPTIONS,
    ALL_VICTIMS,
    DEFAULT_WATERMARKS,
    Run,
    best_watermarks,
    default_workers,
    naive_config,
    paged_config,
    plot_sweep,
    run_all,
    series_label,
    smallest_good_watermarks,
    sweep_runs,
)
from pagedkv.sim.workload import DEFAULT_NUM_JOBS, DEFAULT_PROMPT_FRACTION, DEFAULT_SEED, make_jobs

DEFAULT_NUM_CLIENTS = 128
DEFAULT_NUM_BLOCKS = 4096
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_SWAP_BLOCKS = 1024
#: Bytes per K/V value of the model the cost model describes (bf16), which --blocks counts in.
MODEL_DTYPE_BYTES = 2
#: `--sweep --quick`: a few seconds' sweep that checks the command, not the figures.
QUICK_NUM_JOBS = 32
QUICK_NUM_CLIENTS = 16
QUICK_WATERMARKS = (0.0, 0.05, 0.20)


def build_parser(prog: str = "pagedkv sim") -> argparse.ArgumentParser:
    """The `pagedkv sim` arguments."""
    parser = ArgumentParser(prog=prog, description="Deterministic serving simulator: the engine's scheduler on a "
                                            "simulated clock, naive vs paged (PageFault's stage 4).")
    work = parser.add_argument_group("workload")
    work.add_argument("--jobs", type=int, default=DEFAULT_NUM_JOBS, help="jobs in all (default %(default)s)")
    work.add_argument("--clients", type=int, default=DEFAULT_NUM_CLIENTS,
                      help="closed-loop clients, each with one job in flight (default %(default)s)")
    work.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload seed (default %(default)s)")
    work.add_argument("--prompt-fraction", type=float, default=DEFAULT_PROMPT_FRACTION,
                      help="share of each job's length that is prompt; the rest is generated (default %(default)s)")
    pool = parser.add_argument_group("pool and scheduler")
    pool.add_argument("--blocks", type=int, default=DEFAULT_NUM_BLOCKS,
                      help="KV pool blocks at the model's 16-bit dtype (default %(default)s)")
    pool.add_argument("--kv-cache-dtype", default="auto", metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                      help="FP8 stores 1 byte per value: the memory of --blocks (and --swap-blocks) holds "
                           f"{MODEL_DTYPE_BYTES}x the blocks, and the cost model's KV-read and swap terms scale "
                           "by 1/2 (default %(default)s)")
    pool.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block (default %(default)s)")
    pool.add_argument("--model", default=None,
                      help="a model with sliding-window layers (a calc preset such as gemma3-12b): adds a run that "
                           "keeps a block table per layer group in the same memory as --blocks full-length blocks")
    pool.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                      help="tokens per sequence; naive reserves this much (default %(default)s)")
    pool.add_argument("--max-num-seqs", type=int, default=256, help="scheduler max_num_seqs (default %(default)s)")
    pool.add_argument("--max-num-batched-tokens", type=int, default=2048,
                      help="scheduler token budget per step (default %(default)s)")
    pool.add_argument("--watermark", type=float, default=0.01,
                      help="fraction of the pool admission keeps free, in [0, 1) (default %(default)s)")
    pool.add_argument("--victim", default=None,
                      help=f"victim policy: {', '.join(ALL_VICTIMS)} (default newest; --sweep: all)")
    pool.add_argument("--preemption", default=None,
                      help=f"preemption mode: {', '.join(ALL_PREEMPTIONS)} (default recompute; --sweep: both)")
    pool.add_argument("--swap-blocks", type=int, default=DEFAULT_SWAP_BLOCKS,
                      help="CPU swap space in blocks, used by swap preemption (default %(default)s)")
    run = parser.add_argument_group("run")
    run.add_argument("--sweep", action="store_true", help=f"sweep watermarks {', '.join(f'{w:g}' for w in DEFAULT_WATERMARKS)}")
    run.add_argument("--quick", action="store_true",
                     help=f"with --sweep: {QUICK_NUM_JOBS} jobs, {QUICK_NUM_CLIENTS} clients and watermarks "
                          f"{', '.join(f'{w:g}' for w in QUICK_WATERMARKS)} only (seconds; checks the command)")
    run.add_argument("--fidelity", metavar="RUN_JSON", help="predict a measured engine run (schema: pagedkv.sim.fidelity)")
    run.add_argument("--cost-model", metavar="PATH",
                     help="cost-model JSON, as `pagedkv bench engine` writes it (default: the calibrated H200 "
                          "model shipped in the package)")
    run.add_argument("--workers", type=int, default=None, help="processes for a sweep (default: the CPUs available)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_out_argument(run, "what --sweep, --fidelity, --cluster and --chat-tiers write")
    run.add_argument("--tag", default="", help="suffix of the written file names: sim_sweep_TAG.json (default none)")
    add_cluster_arguments(parser)
    add_chat_tiers_arguments(parser)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    for name in ("jobs", "clients", "blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        require_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    require_positive_int("--swap-blocks", args.swap_blocks, allow_zero=True)
    if args.workers is not None:
        require_positive_int("--workers", args.workers)
    if not 0.0 <= args.watermark < 1.0:
        raise InvalidArgumentError(f"--watermark must be in [0, 1), got {args.watermark}")
    if args.quick and not args.sweep:
        raise InvalidArgumentError("--quick applies only with --sweep")
    if args.model is not None and (args.sweep or args.fidelity or args.cluster):
        raise InvalidArgumentError("--model applies only to the naive vs paged run (not --sweep, --fidelity or "
                                   "--cluster)")
    if args.tag and not all(c.isalnum() or c in "-_." for c in args.tag):
        raise InvalidArgumentError(f"--tag may hold letters, digits, '-', '_' and '.' only; got {args.tag!r}")
    if not 0.0 < args.prompt_fraction < 1.0:
        raise InvalidArgumentError(f"--prompt-fraction must be in (0, 1), got {args.prompt_fraction}")
    for flag, value, choices in (("--victim", args.victim, ALL_VICTIMS), ("--preemption", args.preemption,
                                                                           ALL_PREEMPTIONS)):
        if value is not None and value not in choices:
            raise InvalidArgumentError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


def check_runs_serve_jobs(runs: list[Run], jobs) -> None:
    """Refuse a pool in which some run can serve none of the jobs: it would measure nothing and print zeros."""
    for run in runs:
        scheduler = Scheduler(run.config)
        errors = []
        for job in sorted(jobs, key=lambda job: job.num_tokens):
            try:
                scheduler.check_fits(job.num_prompt_tokens, job.num_output_tokens)
                break
            except RequestRejectedError as error:
                errors.append(error)
        else:
            raise InvalidArgumentError(f"the {run.mode} run would reject all {len(jobs)} jobs (even the smallest: "
                                       f"{errors[0]}); raise --blocks or --block-size")


def kv_blocks_factor(kv_cache_dtype: str) -> int:
    """How many blocks of `kv_cache_dtype` fit in the memory of one 16-bit block (1 for auto, 2 for FP8)."""
    return MODEL_DTYPE_BYTES // kv_cache_dtype_bytes(kv_cache_dtype, MODEL_DTYPE_BYTES)


def apply_kv_cache_dtype(args: argparse.Namespace, cost_model: CostModel) -> CostModel:
    """Scale --blocks / --swap-blocks (in place) and the cost model to the KV cache dtype of the arguments."""
    factor = kv_blocks_factor(args.kv_cache_dtype)
    if factor == 1:
        return cost_model
    args.blocks *= factor
    args.swap_blocks *= factor
    return cost_model.with_kv_bytes(1 / factor, f"KV {args.kv_cache_dtype} (kv and swap terms x1/{factor})")


def grouped_run(paged: SchedulerConfig, model: str) -> Run:
    """`paged` with a table per layer group of `model`, in the same memory (`paged`'s blocks hold every layer).

    A grouped block holds `num_slots` layers, so the same bytes hold num_layers / num_slots
    times the blocks (swap space alike).
    """
    from pagedkv.calc.sizing import preset_sizing

    layout = preset_sizing(model).kv_layout()
    if not layout.is_hybrid:
        raise InvalidArgumentError(f"--model {model} has no sliding-window layers: its grouped run would be the "
                                   "paged run")
    scale = layout.num_layers / layout.num_slots
    config = dataclasses.replace(paged, kv_layout=layout, num_blocks=int(paged.num_blocks * scale),
                                 num_swap_blocks=int(paged.num_swap_blocks * scale))
    return Run("paged per group", config)


def _base_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=args.blocks, block_size=args.block_size, max_model_len=args.max_model_len,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)


def kv_note(args: argparse.Namespace) -> str:
    """'KV bf16' or 'KV fp8_e4m3, 2x the blocks of the same memory'."""
    factor = kv_blocks_factor(args.kv_cache_dtype)
    return "KV bf16" if factor == 1 else f"KV {args.kv_cache_dtype}, {factor}x the blocks of the same memory"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_rows(rows: list[dict]) -> str:
    """The runs as a markdown table."""
    header = ("| mode | preemption | victim | watermark | preemptions | decoding (mean) | admission wait | "
              "throughput (tok/s) | vs naive |")
    lines = [header, "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        watermark = f"{100 * row['watermark']:g}%" if row["mode"] != "naive" else "-"
        lines.append(
            f"| {row['mode']} | {row['preemption'] or '-'} | {row['victim'] or '-'} | "
            f"{watermark} | {row['num_preemptions']} | "
            f"{row['mean_decoding_seqs']:.1f} | {1e3 * row['mean_admission_wait_s']:,.0f} ms | "
            f"{row['throughput_tokens_per_s']:,.0f} | {_fmt(row['throughput_vs_naive'], '.2f')}x |")
    return "\n".join(lines)


def format_pivot(rows: list[dict]) -> str:
    """Throughput vs naive: one row per watermark, one column per series, then where each series peaks."""
    labels = list(dict.fromkeys(series_label(r) for r in rows if r["mode"] == "paged"))
    watermarks = sorted({r["watermark"] for r in rows if r["mode"] == "paged"})
    cell = {(series_label(r), r["watermark"]): r for r in rows if r["mode"] == "paged"}
    lines = ["| watermark | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    for watermark in watermarks:
        values = [_fmt(cell[(label, watermark)]["throughput_vs_naive"], ".2f") + "x" if (label, watermark) in cell
                  else "-" for label in labels]
        lines.append(f"| {100 * watermark:g}% | " + " | ".join(values) + " |")
    best = best_watermarks(rows)
    good = smallest_good_watermarks(rows)
    lines.append("| best | " + " | ".join(f"{100 * best[label]['watermark']:g}%" for label in labels) + " |")
    lines.append("| within 1% of best from | " + " | ".join(f"{100 * good[label]['watermark']:g}%" for label in labels)
                 + " |")
    return "\n".join(lines)


def _describe_workload(args: argparse.Namespace, jobs) -> str:
    total = sum(job.num_tokens for job in jobs)
    outputs = sum(job.num_output_tokens for job in jobs)
    clients = f"{args.clients} closed-loop clients"
    return (f"workload: {len(jobs)} jobs (seed {args.seed}, PageFault mix, prompt {args.prompt_fraction:g} of each "
            f"length), {total:,} tokens, {outputs:,} generated; {clients}; pool {args.blocks} blocks x "
            f"{args.block_size} tokens ({kv_note(args)}), max_model_len {args.max_model_len}")


def _file_name(stem: str, tag: str) -> str:
    return f"{stem}_{tag}" if tag else stem


def _provenance() -> dict:
    from pagedkv.results import provenance

    return provenance("simulated (cost model)")


def _run_fidelity(args: argparse.Namespace, cost_model: CostModel) -> int:
    from pagedkv.results import write_json

    run = load_engine_run(args.fidelity)
    result = predict(run, cost_model)
    payload = {"engine_run": str(args.fidelity), "name": result.name, "cost_model": cost_model.constants(),
               "cost_model_source": cost_model.source, "measured_tokens_per_s": result.measured_tokens_per_s,
               "predicted_tokens_per_s": result.predicted_tokens_per_s, "relative_error": result.relative_error,
               "within_target": result.is_within_target, "target": TARGET_RELATIVE_ERROR, "sim": result.sim.to_dict()}
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print(cost_model.describe())
        print(f"engine run: {result.name}: {len(run.jobs)} requests, {run.config.num_blocks} blocks x "
              f"{run.config.block_size}, max_num_seqs {run.config.max_num_seqs}, max_num_batched_tokens "
              f"{run.config.max_num_batched_tokens}")
        print(f"measured  {result.measured_tokens_per_s:,.1f} tok/s")
        print(f"simulated {result.predicted_tokens_per_s:,.1f} tok/s ({result.sim.num_steps} steps, "
              f"{result.sim.num_preemptions} preemptions)")
        verdict = "within" if result.is_within_target else "OUTSIDE"
        print(f"relative error {result.relative_error:+.1%} ({verdict} the {TARGET_RELATIVE_ERROR:.0%} target)")
    path = write_json(args.out, _file_name("sim_fidelity", args.tag), {**payload, "provenance": _provenance()})
    if not args.json:
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None, prog: str = "pagedkv sim") -> int:
    """`pagedkv sim`: naive vs paged, a watermark sweep, or a fidelity check against a measured engine run."""
    args = build_parser(prog).parse_args(argv)
    _check_args(args)
    cost_model = apply_kv_cache_dtype(args, resolve_cost_model(args.cost_model))
    if args.cluster:
        return run_cluster(args, cost_model)
    if args.chat_tiers:
        return run_chat_tiers(args, cost_model)
    if args.fidelity:
        return _run_fidelity(args, cost_model)

    if args.quick:
        args.jobs, args.clients = QUICK_NUM_JOBS, QUICK_NUM_CLIENTS
    base = _base_config(args)
    if args.sweep:
        preemptions = [args.preemption] if args.preemption else list(ALL_PREEMPTIONS)
        victims = [args.victim] if args.victim else list(ALL_VICTIMS)
        watermarks = QUICK_WATERMARKS if args.quick else DEFAULT_WATERMARKS
        runs = sweep_runs(base, watermarks, preemptions, victims, args.swap_blocks)
    else:
        runs = [Run("naive", naive_config(base)),
                Run("paged", paged_config(base, args.watermark, args.preemption or "recompute",
                                          args.victim or "newest", args.swap_blocks))]
        if args.model is not None:
            runs.append(grouped_run(runs[-1].config, args.model))
    jobs = make_jobs(args.jobs, seed=args.seed, prompt_fraction=args.prompt_fraction)
    check_runs_serve_jobs(runs, jobs)
    workers = args.workers or default_workers()
    started = time.perf_counter()
    rows = run_all(runs, jobs, cost_model, args.clients, workers=workers if args.sweep else 1)
    wall_s = time.perf_counter() - started

    payload = {
        "workload": {"jobs": args.jobs, "clients": args.clients, "seed": args.seed,
                     "prompt_fraction": args.prompt_fraction, "num_tokens": sum(j.num_tokens for j in jobs),
                     "num_output_tokens": sum(j.num_output_tokens for j in jobs)},
        "pool": {"num_blocks": args.blocks, "kv_cache_dtype": args.kv_cache_dtype, "block_size": args.block_size,
                 "max_model_len": args.max_model_len,
                 "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                 "num_swap_blocks": args.swap_blocks},
        "cost_model": cost_model.constants(),
        "cost_model_source": cost_model.source,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print(cost_model.describe())
        print(_describe_workload(args, jobs))
        print()
        print(format_rows(rows))
        if args.sweep:
            print()
            print("Throughput relative to naive:")
            print()
            print(format_pivot(rows))
    if args.sweep:
        from pagedkv.results import write_json

        json_path = write_json(args.out, _file_name("sim_sweep", args.tag), {**payload, "wall_s": wall_s, "provenance": _provenance()})
        png_path = plot_sweep(rows, json_path.with_suffix(".png"),
                              f"pagedkv sim: {args.jobs} jobs, {args.clients} clients, {args.blocks} blocks")
        if not args.json:
            print()
            print(f"wrote {json_path} and {png_path}")
    return 0
