"""`pagedkv demo`: the main job, shown to a person.

`memory_demo` runs the paging core alone (a mixed workload, naive vs paged reservation, a
block-size sweep); `engine_demo` (in `pagedkv.engine.demo`) runs the real model.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from pagedkv.core import BlockAllocator, BlockTable, ModelSpec, generate_lengths, memory_report

SMOLLM2_SPEC = ModelSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2, name="SmolLM2-135M (bf16)")


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.2f} MB"


def memory_demo(num_seqs: int = 32, seed: int = 42, max_seq_len: int = 2048, block_size: int = 16,
                num_blocks: int = 4096, spec: ModelSpec = SMOLLM2_SPEC, console: Console | None = None) -> dict:
    """Place a mixed workload in a real allocator, then compare naive and paged reservation."""
    console = console or Console()
    lengths = generate_lengths(num_seqs, seed=seed)
    allocator = BlockAllocator(num_blocks)
    tables = []
    for length in lengths:
        table = BlockTable(allocator, block_size, max_num_tokens=max_seq_len)
        table.append_tokens(length)
        tables.append(table)
    allocator.check_integrity()
    report = memory_report(lengths, block_size, max_seq_len, spec.bytes_per_token)
    assert allocator.num_used == report.num_blocks, "allocator and accounting disagree"

    console.print(f"[bold]Workload[/bold]: {num_seqs} sequences, seed {seed}, lengths "
                  f"{min(lengths)}..{max(lengths)} (mean {sum(lengths) / len(lengths):.0f}), "
                  f"max_seq_len {max_seq_len}, model {spec.name}: {spec.bytes_per_token:,} B/token")
    table = Table(title="KV memory: naive contiguous vs paged")
    for column in ("", "naive", "paged"):
        table.add_column(column, justify="right")
    table.add_row("reserved tokens", f"{report.naive_reserved_tokens:,}", f"{report.paged_reserved_tokens:,}")
    table.add_row("reserved memory", _mb(report.naive_reserved_bytes), _mb(report.paged_reserved_bytes))
    table.add_row("utilization", f"{report.naive_utilization:.1%}", f"{report.paged_utilization:.1%}")
    table.add_row("blocks in pool", "-", f"{allocator.num_used} / {num_blocks}")
    table.add_row("fragmentation / seq", "-", f"{report.fragmentation_per_seq:.2f} tokens "
                  f"(expected ~{(block_size - 1) / 2:.1f})")
    table.add_row("savings", "1.00x", f"{report.savings:.2f}x")
    console.print(table)

    sweep = Table(title="Block-size sweep (the page-size trade-off)")
    for column in ("block size", "reserved", "fragmentation", "utilization", "table entries / seq"):
        sweep.add_column(column, justify="right")
    sweep_rows = []
    for size in (1, 16, 64, 256):
        r = memory_report(lengths, size, max_seq_len, spec.bytes_per_token)
        sweep_rows.append({"block_size": size, "reserved_bytes": r.paged_reserved_bytes,
                           "fragmentation_bytes": r.fragmentation_bytes, "utilization": r.paged_utilization,
                           "table_entries_per_seq": r.table_entries_per_seq})
        sweep.add_row(str(size), _mb(r.paged_reserved_bytes), _mb(r.fragmentation_bytes),
                      f"{r.paged_utilization:.1%}", str(r.table_entries_per_seq))
    console.print(sweep)

    for t in tables:
        t.free()
    allocator.check_integrity()
    console.print(f"All {num_seqs} sequences freed: {allocator.num_used} blocks in use, "
                  f"peak {allocator.peak_used}.")
    return {"lengths": lengths, "naive_reserved_bytes": report.naive_reserved_bytes,
            "paged_reserved_bytes": report.paged_reserved_bytes, "sweep": sweep_rows}


def main(argv: list[str] | None = None, prog: str = "pagedkv demo") -> int:
    """`pagedkv demo`: the engine demo on the embedded model, or `--memory` for the paging core alone."""
    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("--memory", action="store_true", help="the paging-core memory demo only (no model)")
    parser.add_argument("--seqs", type=int, default=32, help="sequences in the memory demo")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    memory_demo(num_seqs=args.seqs, seed=args.seed, block_size=args.block_size)
    return 0
