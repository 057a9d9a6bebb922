"""`pagedkv calc`: the KV-cache calculator's command line (argparse over the typed functions).

Three sections, each printed when its arguments ask for it:

    no model args          the toy workload: naive vs paged, block-size sweep (PageFault's calculator)
    --model / --config     KV sizing of a real model (with sliding-window layers: per layer group, and a
                           sequence at --max-len against full-length reservation and full-length paging)
    + --budget-gb          concurrent sequences a KV budget holds, naive vs paged
    + --kv-dtype fp8       the same with an FP8 KV cache (1 byte per value), beside the model dtype's figures
    + --kv-offload-memory  KV tiers: what a host (and --kv-offload-disk) tier holds, restore vs recompute

Then the formulas used, with this run's numbers. `--json` prints one JSON object instead.
Bad input raises `InvalidArgumentError` / `ConfigError` (argparse's own errors too), which
`pagedkv.cli` prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from pagedkv.calc.capacity import (
    GB,
    SWEEP_BLOCK_SIZES,
    TOY_SPEC,
    BudgetCapacity,
    Formula,
    block_size_sweep,
    budget_capacity,
    budget_formulas,
    sizing_formulas,
    workload_formulas,
)
from pagedkv.calc.groups import groups_formulas, groups_section
from pagedkv.calc.render import dtype_label, render
from pagedkv.calc.sizing import DTYPE_BYTES, PRESETS, KVSizing, custom_sizing, preset_sizing, spec_from_config_file
from pagedkv.core import DEFAULT_MIX, MemoryReport, generate_lengths, memory_report
from pagedkv.calc.tiers import tiers_formulas, tiers_section
from pagedkv.cli import ArgumentParser, parse_size
from pagedkv.errors import InvalidArgumentError

__all__ = ["build_parser", "compute", "dtype_label", "main", "render", "sizing_from_args"]  # render.py prints

DEFAULT_NUM_SEQS = 32
DEFAULT_SEED = 42
DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_POOL_BLOCKS = 4096
#: --budget-gb's mean sequence length when --mean-len is not given: PageFault's example workload.
DEFAULT_MEAN_LEN = 2000
#: The toy workload illustrates; it is simulated sequence by sequence, so it stays small enough to print at once.
MAX_NUM_SEQS = 100_000


def build_parser(prog: str = "pagedkv calc") -> argparse.ArgumentParser:
    """The `pagedkv calc` arguments (workload flags default to None so we can tell they were given)."""
    parser = ArgumentParser(prog=prog, description="KV-cache capacity calculator: naive contiguous vs paged.")
    workload = parser.add_argument_group("toy workload (no model args)")
    workload.add_argument("--seqs", type=int, help=f"sequences in the workload, at most {MAX_NUM_SEQS:,} "
                          f"(default {DEFAULT_NUM_SEQS})")
    workload.add_argument("--seed", type=int, help=f"workload seed (default {DEFAULT_SEED})")
    workload.add_argument("--num-blocks", type=int, help=f"blocks in the pool (default {DEFAULT_NUM_POOL_BLOCKS})")
    common = parser.add_argument_group("both")
    common.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block (default 16)")
    common.add_argument("--max-len", type=int, help=f"max sequence length (default {DEFAULT_MAX_SEQ_LEN} for the "
                        "workload, the model's max_position_embeddings otherwise)")
    model = parser.add_argument_group("model sizing")
    source = model.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"a preset: {', '.join(PRESETS)}, or custom")
    source.add_argument("--config", help="a Hugging Face config.json (or a model folder holding one)")
    model.add_argument("--layers", type=int, help="--model custom: attention layers")
    model.add_argument("--kv-heads", type=int, help="--model custom: KV heads")
    model.add_argument("--head-dim", type=int, help="--model custom: head dimension")
    model.add_argument("--dtype-bytes", type=int, help="bytes per KV value (overrides the config's dtype; "
                       "default 2 for custom)")
    model.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                       help="the KV cache's dtype: auto (the model's), bf16, fp16, fp32, fp8, fp8_e4m3 or fp8_e5m2; "
                            "another dtype than the model's is shown beside it (default auto)")
    budget = parser.add_argument_group("budget")
    budget.add_argument("--budget-gb", type=float, help="KV memory budget in GB (1e9 bytes)")
    budget.add_argument("--mean-len", type=int, help=f"mean sequence length for the paged estimate (default "
                        f"{DEFAULT_MEAN_LEN:,}, PageFault's example, or --max-len if that is shorter)")
    tiers = parser.add_argument_group("KV tiers (docs/kv-tiers.md)")
    tiers.add_argument("--kv-offload-memory", type=parse_size, default=None, metavar="SIZE",
                       help="a host tier of SIZE (e.g. 64GiB): tokens it holds, and restoring a prompt against "
                            "computing it, at the packaged cost model's bandwidths")
    tiers.add_argument("--kv-offload-disk", type=parse_size, default=0, metavar="SIZE",
                       help="with --kv-offload-memory: a disk tier of SIZE behind it")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """Every size given must be positive, and every flag must belong to a section that runs."""
    for flag in ("seqs", "num_blocks", "block_size", "max_len", "layers", "kv_heads", "head_dim",
                 "dtype_bytes", "mean_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InvalidArgumentError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.seqs is not None and args.seqs > MAX_NUM_SEQS:
        raise InvalidArgumentError(f"--seqs must be <= {MAX_NUM_SEQS:,} (the toy workload is an illustration), "
                                   f"got {args.seqs:,}")
    if args.budget_gb is not None and not (math.isfinite(args.budget_gb) and args.budget_gb > 0):
        raise InvalidArgumentError(f"--budget-gb must be a positive number of GB, got {args.budget_gb}")
    has_model = args.model is not None or args.config is not None
    if has_model:
        given = [f"--{flag.replace('_', '-')}" for flag in ("seqs", "seed", "num_blocks")
                 if getattr(args, flag) is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise InvalidArgumentError(f"{', '.join(given)} {verb} only to the toy workload, "
                                       "not with --model/--config")
    if args.model != "custom":
        given = [f"--{flag.replace('_', '-')}" for flag in ("layers", "kv_heads", "head_dim")
                 if getattr(args, flag) is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise InvalidArgumentError(f"{', '.join(given)} {verb} only with --model custom")
    if args.kv_dtype != "auto":
        if args.kv_dtype not in DTYPE_BYTES:
            raise InvalidArgumentError(f"--kv-dtype {args.kv_dtype!r} is not a dtype calc knows; choose one of auto, "
                                       f"{', '.join(KV_DTYPE_NAMES)}")
        if not has_model:
            raise InvalidArgumentError("--kv-dtype needs a model: pass --model or --config")
        if args.dtype_bytes is not None:
            raise InvalidArgumentError("--kv-dtype and --dtype-bytes both set the bytes per KV value; pass one")
    if args.budget_gb is not None:
        if not has_model:
            raise InvalidArgumentError("--budget-gb needs a model: pass --model or --config")
    elif args.mean_len is not None:
        raise InvalidArgumentError("--mean-len applies only with --budget-gb")
    if args.kv_offload_memory is not None and not has_model:
        raise InvalidArgumentError("--kv-offload-memory needs a model: pass --model or --config")
    if args.kv_offload_disk and args.kv_offload_memory is None:
        raise InvalidArgumentError("--kv-offload-disk needs --kv-offload-memory (the disk tier stages through it)")


#: --kv-dtype names (besides auto), shortest first.
KV_DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2")


def sizing_from_args(args: argparse.Namespace, *, model_dtype: bool = False) -> KVSizing | None:
    """The model the arguments name (with --kv-dtype's bytes unless `model_dtype`), or None for the toy workload."""
    dtype_bytes, origin = args.dtype_bytes, f"--dtype-bytes {args.dtype_bytes}"
    if args.kv_dtype != "auto" and not model_dtype:
        dtype_bytes, origin = DTYPE_BYTES[args.kv_dtype], f"--kv-dtype {args.kv_dtype}"
    if args.config is not None:
        return spec_from_config_file(args.config, dtype_bytes=dtype_bytes, dtype_origin=origin)
    if args.model is None:
        return None
    if args.model == "custom":
        missing = [f"--{flag.replace('_', '-')}" for flag in ("layers", "kv_heads", "head_dim")
                   if getattr(args, flag) is None]
        if missing:
            raise InvalidArgumentError(f"--model custom needs --layers, --kv-heads and --head-dim "
                                       f"(missing {', '.join(missing)})")
        return custom_sizing(args.layers, args.kv_heads, args.head_dim, dtype_bytes or 2)
    return preset_sizing(args.model, dtype_bytes=dtype_bytes, dtype_origin=origin)


# ---------------------------------------------------------------------- sections as JSON-ready dicts
def _sizing_dict(sizing: KVSizing, block_size: int, max_len: int | None) -> dict[str, Any]:
    fields = dataclasses.asdict(sizing)
    fields.pop("notes")
    return {**fields, "bytes_per_token": sizing.bytes_per_token,
            "bytes_per_token_per_layer": sizing.bytes_per_token_per_layer, "block_size": block_size,
            "page_size_bytes": sizing.page_size_bytes(block_size), "max_len": max_len,
            "seq_kv_bytes_at_max_len": sizing.seq_kv_bytes(max_len) if max_len else None}


def _capacity_dict(capacity: BudgetCapacity) -> dict[str, Any]:
    return {**dataclasses.asdict(capacity), "num_blocks_per_seq": capacity.num_blocks_per_seq,
            "num_naive_seqs": capacity.num_naive_seqs, "num_paged_seqs": capacity.num_paged_seqs,
            "gain": capacity.gain}


def _report_dict(report: MemoryReport) -> dict[str, Any]:
    return {"block_size": report.block_size, "num_blocks": report.num_blocks,
            "stored_tokens": report.stored_tokens, "naive_reserved_bytes": report.naive_reserved_bytes,
            "paged_reserved_bytes": report.paged_reserved_bytes, "fragmentation_bytes": report.fragmentation_bytes,
            "fragmentation_per_seq": report.fragmentation_per_seq, "naive_utilization": report.naive_utilization,
            "paged_utilization": report.paged_utilization, "savings": report.savings,
            "table_entries_per_seq": report.table_entries_per_seq}


def _workload(args: argparse.Namespace, notes: list[str]) -> tuple[dict[str, Any], list[Formula]]:
    num_seqs = DEFAULT_NUM_SEQS if args.seqs is None else args.seqs
    seed = DEFAULT_SEED if args.seed is None else args.seed
    max_seq_len = args.max_len or DEFAULT_MAX_SEQ_LEN
    num_pool_blocks = args.num_blocks or DEFAULT_NUM_POOL_BLOCKS
    lengths = generate_lengths(num_seqs, seed=seed)
    if max(lengths) > max_seq_len:
        raise InvalidArgumentError(f"--max-len {max_seq_len} is below the workload's longest sequence "
                                   f"({max(lengths):,} tokens; the length mix reaches {DEFAULT_MIX[-1].max_len:,})")
    report = memory_report(lengths, args.block_size, max_seq_len, TOY_SPEC.bytes_per_token)
    sweep_sizes = sorted({*SWEEP_BLOCK_SIZES, args.block_size})
    sweep = block_size_sweep(lengths, max_seq_len, TOY_SPEC.bytes_per_token, sweep_sizes)
    if report.num_blocks > num_pool_blocks:
        notes.append(f"the workload needs {report.num_blocks:,} blocks, more than the pool's {num_pool_blocks:,}")
    notes.append(f"bytes/token is {TOY_SPEC.name}; pass --model or --config to size a real model")
    buckets = {bucket.name: sum(bucket.min_len <= n <= bucket.max_len for n in lengths) for bucket in DEFAULT_MIX}
    section = {"num_seqs": num_seqs, "seed": seed, "max_seq_len": max_seq_len, "num_pool_blocks": num_pool_blocks,
               "bytes_per_token": TOY_SPEC.bytes_per_token, "lengths": lengths, "buckets": buckets,
               **_report_dict(report), "sweep": [_report_dict(r) for r in sweep]}
    return section, workload_formulas(TOY_SPEC, report, num_pool_blocks)


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """Every section the arguments ask for, as one JSON-ready dict (what `--json` prints)."""
    _check_args(args)
    sizing = sizing_from_args(args)
    result: dict[str, Any] = {"model": None, "budget": None, "workload": None, "formulas": [], "notes": [],
                              "kv_dtype": args.kv_dtype, "model_dtype": None, "model_dtype_budget": None,
                              "groups": None, "kv_tiers": None}
    notes: list[str] = result["notes"]
    formulas: list[Formula] = []
    if sizing is None:
        result["workload"], formulas = _workload(args, notes)
    else:
        notes.extend(sizing.notes)
        max_len = args.max_len or sizing.max_position_embeddings
        if args.max_len and sizing.max_position_embeddings and args.max_len > sizing.max_position_embeddings:
            notes.append(f"--max-len {args.max_len:,} is past the model's max_position_embeddings "
                         f"{sizing.max_position_embeddings:,}")
        result["model"] = _sizing_dict(sizing, args.block_size, max_len)
        formulas = sizing_formulas(sizing, args.block_size)
        if sizing.num_sliding_layers and max_len:
            budget = round(args.budget_gb * GB) if args.budget_gb is not None else None
            result["groups"] = groups_section(sizing, max_len, args.block_size, budget)
            formulas += groups_formulas(result["groups"])
        baseline = sizing_from_args(args, model_dtype=True) if args.kv_dtype != "auto" else None
        if baseline is not None and baseline.dtype_bytes == sizing.dtype_bytes:
            baseline = None  # --kv-dtype names the model's own dtype: nothing to compare
        if baseline is not None:
            result["model_dtype"] = _sizing_dict(baseline, args.block_size, max_len)
        if args.budget_gb is not None:
            if max_len is None:
                raise InvalidArgumentError("--budget-gb needs --max-len (the model gives no max_position_embeddings)")
            mean_len = args.mean_len
            if mean_len is None:
                mean_len = min(DEFAULT_MEAN_LEN, max_len)
                notes.append(f"--mean-len not given: the paged count assumes sequences average {mean_len:,} tokens "
                             f"(PageFault's example, capped at the max length); pass --mean-len for your workload")
            elif mean_len > max_len:
                limit = f"--max-len {max_len:,}" if args.max_len else \
                    f"the model's max_position_embeddings {max_len:,} (pass --max-len)"
                raise InvalidArgumentError(f"--mean-len {mean_len:,} is over {limit}")
            capacity = budget_capacity(sizing, round(args.budget_gb * GB), max_len, mean_len, args.block_size)
            result["budget"] = _capacity_dict(capacity)
            if baseline is not None:
                base = budget_capacity(baseline, round(args.budget_gb * GB), max_len, mean_len, args.block_size)
                result["model_dtype_budget"] = _capacity_dict(base)
                notes.append(f"KV dtype {args.kv_dtype}: {sizing.dtype_bytes} B per value against the model's "
                             f"{baseline.dtype_bytes}; {capacity.num_paged_seqs} paged sequences against "
                             f"{base.num_paged_seqs} ({capacity.num_paged_seqs / max(1, base.num_paged_seqs):.2f}x)")
            formulas += budget_formulas(sizing, capacity)
            if capacity.num_naive_seqs == 0:
                notes.append("the budget cannot hold one sequence reserved at the max length")
            notes.append("the paged count assumes sequences average --mean-len; a batch of longer ones holds fewer")
        if args.kv_offload_memory is not None:
            layout = sizing.kv_layout() if sizing.num_sliding_layers else None
            tiers = tiers_section(sizing.bytes_per_token, args.block_size, args.kv_offload_memory, args.kv_offload_disk,
                                  layout)
            result["kv_tiers"] = tiers
            formulas += tiers_formulas(tiers, sizing.bytes_per_token, args.block_size)
    result["formulas"] = [formula._asdict() for formula in formulas]
    return result



def main(argv: list[str] | None = None, prog: str = "pagedkv calc") -> int:
    """`pagedkv calc`: config and workload, model sizing, or budget -> concurrent sequences."""
    args = build_parser(prog).parse_args(argv)
    result = compute(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result)
    return 0
