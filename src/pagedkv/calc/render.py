"""Printing the calculator's result: `pagedkv calc`'s tables, then the formulas and notes.

`pagedkv.calc.cli.compute` returns every section as a JSON-ready dict (what `--json` prints); `render`
prints the same dict as rich tables: the toy workload and its block-size sweep, a model's KV sizing,
the budget's naive against paged columns (with the model dtype's beside another KV dtype's), and the
layer-group and KV-tier sections through their own modules' printers.
"""

from __future__ import annotations

from typing import Any

from pagedkv.calc.capacity import MB, format_bytes, format_per_token
from pagedkv.calc.groups import render_groups
from pagedkv.calc.tiers import print_tiers


def dtype_label(dtype_bytes: int) -> str:
    """A column label for a KV dtype of `dtype_bytes` bytes: fp8, 16-bit (bf16 or fp16) or fp32."""
    return {1: "fp8", 2: "16-bit", 4: "fp32"}.get(dtype_bytes, f"{dtype_bytes} B")


def _table(title: str, *columns: str):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    return table


def _print_workload(console, w: dict[str, Any]) -> None:
    lengths = w["lengths"]
    pool_tokens = w["num_pool_blocks"] * w["block_size"]
    config = _table("Configuration", "", "value")
    config.add_row("sequences / seed", f"{w['num_seqs']} / {w['seed']}")
    config.add_row("max_seq_len", f"{w['max_seq_len']:,} tokens")
    config.add_row("block size (B)", f"{w['block_size']} tokens")
    config.add_row("pool", f"{w['num_pool_blocks']:,} blocks = {pool_tokens:,} tokens = "
                   f"{format_bytes(pool_tokens * w['bytes_per_token'])}")
    config.add_row("bytes/token", f"{w['bytes_per_token']:,} B")
    console.print(config)
    mix = ", ".join(f"{count} {name}" for name, count in w["buckets"].items())
    console.print(f"Workload: lengths {min(lengths):,}..{max(lengths):,}, mean {sum(lengths) / len(lengths):,.0f} "
                  f"({mix}), {w['stored_tokens']:,} tokens stored", highlight=False)

    util = _table("KV memory: naive contiguous vs paged", "", "naive", "paged")
    util.add_row("reserved tokens", f"{w['num_seqs'] * w['max_seq_len']:,}", f"{w['num_blocks'] * w['block_size']:,}")
    util.add_row("reserved memory", format_bytes(w["naive_reserved_bytes"]), format_bytes(w["paged_reserved_bytes"]))
    util.add_row("utilization", f"{w['naive_utilization']:.1%}", f"{w['paged_utilization']:.1%}")
    util.add_row("blocks in pool", "-", f"{w['num_blocks']:,} / {w['num_pool_blocks']:,}")
    util.add_row("fragmentation / seq", "-", f"{w['fragmentation_per_seq']:.2f} tokens")
    util.add_row("savings", "1.00x", f"{w['savings']:.2f}x")
    console.print(util)

    sweep = _table("Block-size sweep (the page-size trade-off)", "block size", "reserved", "fragmentation",
                   "utilization", "table entries / seq")
    for row in w["sweep"]:
        # One unit down the column, as PageFault prints it, so the rows compare at a glance.
        sweep.add_row(f"{row['block_size']}", f"{row['paged_reserved_bytes'] / MB:,.2f} MB",
                      f"{row['fragmentation_bytes'] / MB:,.2f} MB", f"{row['paged_utilization']:.1%}",
                      f"{row['table_entries_per_seq']:,}")
    console.print(sweep)


def _print_model(console, m: dict[str, Any], base: dict[str, Any] | None = None) -> None:
    table = _table(f"KV cache of {m['name']}", "", "value")
    layers = f"{m['num_layers']}"
    if m["num_sliding_layers"]:
        layers += (f" ({m['num_layers'] - m['num_sliding_layers']} full, {m['num_sliding_layers']} sliding, "
                   f"window {m['sliding_window_tokens']:,})")
    table.add_row("layers", layers)
    if m["is_mla"]:
        table.add_row("cached per token per layer", f"1 MLA latent of {m['head_dim']}")
    else:
        table.add_row("KV heads x head_dim", f"{m['num_kv_heads']} x {m['head_dim']}")
    table.add_row("dtype bytes", f"{m['dtype_bytes']}")
    table.add_row("KV per token", format_per_token(m["bytes_per_token"]))
    if base is not None:
        table.add_row(f"KV per token ({dtype_label(base['dtype_bytes'])}, the model's)",
                      format_per_token(base["bytes_per_token"]))
    table.add_row(f"KV per block ({m['block_size']} tokens)", format_bytes(m["page_size_bytes"]))
    if m["max_position_embeddings"]:
        table.add_row("max_position_embeddings", f"{m['max_position_embeddings']:,}")
    if m["max_len"]:
        table.add_row(f"KV per {m['max_len']:,}-token sequence", format_bytes(m["seq_kv_bytes_at_max_len"]))
    console.print(table)


def _budget_cells(b: dict[str, Any]) -> list[tuple[str, str]]:
    """(naive, paged) cells of each row of the budget table."""
    gain = "-" if b["gain"] is None else f"{b['gain']:.1f}x"
    return [(f"{b['max_len']:,} (max len)", f"{b['num_blocks_per_seq'] * b['block_size']:,} "
             f"({b['num_blocks_per_seq']:,} blocks of {b['block_size']})"),
            (format_bytes(b["naive_bytes_per_seq"]), format_bytes(b["paged_bytes_per_seq"])),
            (f"{b['num_naive_seqs']:,}", f"{b['num_paged_seqs']:,}"),
            ("1.0x" if b["num_naive_seqs"] else "-", gain)]


def _print_budget(console, b: dict[str, Any], bytes_per_value: int, base: dict[str, Any] | None = None,
                  base_bytes: int = 0) -> None:
    """Naive vs paged; with `base` (the model dtype's figures) its two columns first, then this KV dtype's."""
    labels = ("tokens per sequence", "KV per sequence", "concurrent sequences", "vs naive")
    title = f"KV budget {format_bytes(b['budget_bytes'])}: naive vs paged"
    if base is None:
        table = _table(title, "", "naive", "paged")
        for label, cells in zip(labels, _budget_cells(b)):
            table.add_row(label, *cells)
    else:
        kv, model = dtype_label(bytes_per_value), dtype_label(base_bytes)
        table = _table(title + f", {model} against {kv} KV", "", f"naive {model}", f"paged {model}",
                       f"naive {kv}", f"paged {kv}")
        for label, base_cells, cells in zip(labels, _budget_cells(base), _budget_cells(b)):
            table.add_row(label, *base_cells, *cells)
        ratio = b["num_paged_seqs"] / base["num_paged_seqs"] if base["num_paged_seqs"] else None
        table.add_row(f"paged vs paged {model}", "", "1.0x", "", "-" if ratio is None else f"{ratio:.2f}x")
    console.print(table)


def render(result: dict[str, Any]) -> None:
    """Print `compute`'s result as tables, then the formulas and notes."""
    from rich.console import Console

    console = Console()
    if result["workload"]:
        _print_workload(console, result["workload"])
    base = result.get("model_dtype")
    if result["model"]:
        _print_model(console, result["model"], base)
    if result["groups"]:
        render_groups(console, result["groups"], _table)
    if result["budget"]:
        _print_budget(console, result["budget"], result["model"]["dtype_bytes"], result.get("model_dtype_budget"),
                      base["dtype_bytes"] if base else 0)
    if result["kv_tiers"]:
        print_tiers(console, result["kv_tiers"], _table)
    block_size = (result["workload"] or result["model"])["block_size"]
    console.print(f"Core formulas (B = block size = {block_size}, GB = 1e9 B, MB = 1e6 B):", highlight=False)
    width = max(len(f["name"]) for f in result["formulas"])
    for f in result["formulas"]:
        console.print(f"  {f['name']:<{width}} = {f['formula']}\n  {'':<{width}} = {f['value']}",
                      markup=False, highlight=False, soft_wrap=True)
    for note in result["notes"]:
        console.print(f"Note: {note}", markup=False, highlight=False)
