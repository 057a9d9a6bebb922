"""The `pagedkv` command line: a thin argparse layer over typed functions.

Every subcommand's work lives elsewhere; heavy modules are imported only by the subcommand
that needs them. A `PagedKVError` becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from pagedkv.errors import PagedKVError


def _cmd_bench_allocator(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from pagedkv.bench import allocator
    from pagedkv.bench.common import provenance, write_json

    result = allocator.run(num_pairs=args.pairs)
    result["provenance"] = provenance()
    table = Table(title="Allocator throughput (CPython, one core)")
    for column in ("pool blocks", "alloc+free pairs/s (single)", "pairs/s (list API)",
                   f"allocs/s ({result['rows'][0]['blocks_per_multi_alloc']} blocks)"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(f"{row['num_blocks']:,}", f"{row['single_pairs_per_s']:,.0f}",
                      f"{row['list_api_pairs_per_s']:,.0f}", f"{row['multi_allocs_per_s']:,.0f}")
    Console().print(table)
    best = result["rows"][0]["single_pairs_per_s"]
    print(f"target >= {result['target_pairs_per_s']:,} pairs/s: {'met' if best >= 2e6 else 'MISSED'} "
          f"({best:,.0f}); 1M-block pool / 1K-block pool = {result['large_over_small_single']:.2f} "
          f"(O(1) target: >= 0.80, {'met' if result['large_over_small_single'] >= 0.8 else 'MISSED'})")
    print(f"wrote {write_json(args.out, 'allocator', result)}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pagedkv.demo import memory_demo

    memory_demo(num_seqs=args.seqs, seed=args.seed, block_size=args.block_size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="pagedkv", description="A paged KV cache for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the main demonstration")
    demo.add_argument("--memory", action="store_true", help="the paging-core memory demo only (no model)")
    demo.add_argument("--seqs", type=int, default=32)
    demo.add_argument("--seed", type=int, default=42)
    demo.add_argument("--block-size", type=int, default=16)
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    alloc = bench_sub.add_parser("allocator", help="allocator alloc/free throughput")
    alloc.add_argument("--pairs", type=int, default=1_000_000)
    alloc.add_argument("--out", default="benchmarks/results")
    alloc.set_defaults(func=_cmd_bench_allocator)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PagedKVError as error:
        print(f"pagedkv: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
