"""The `pagedkv` command line: a thin argparse layer over typed functions.

Each subcommand is a `main(argv) -> int` in the module that owns the work, imported only
when that subcommand runs (so `pagedkv calc` never imports torch). A `PagedKVError`
becomes one line on stderr and exit status 2, with no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv.errors import InvalidArgumentError, PagedKVError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one `InvalidArgumentError` line (exit 2 via `main`), not a usage dump."""

    def error(self, message: str):
        raise InvalidArgumentError(message)

#: subcommand -> (module with `main(argv)`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("pagedkv.demo", "the main demo: the embedded model through the engine (--memory: paging core only)"),
    "generate": ("pagedkv.engine.cli", "generate text for one or more prompts"),
    "serve": ("pagedkv.server.cli", "OpenAI-compatible HTTP server"),
    "calc": ("pagedkv.calc", "KV-cache capacity calculator"),
    "sim": ("pagedkv.sim.cli", "deterministic serving simulator (drives the engine's scheduler)"),
}

#: `pagedkv bench NAME` -> module with `main(argv)`
BENCHMARKS: dict[str, tuple[str, str]] = {
    "allocator": ("pagedkv.bench.allocator", "allocator alloc/free throughput (CPU)"),
    "kernel": ("pagedkv.bench.kernel", "paged attention kernels vs SDPA (GPU)"),
    "hf": ("pagedkv.bench.hf", "PagedCache vs DynamicCache/StaticCache in model.generate (GPU)"),
    "engine": ("pagedkv.bench.engine", "engine throughput on nano-vllm's offline workload (GPU)"),
    "latency": ("pagedkv.bench.latency", "decode step time at batch 1..256 against the roofline (GPU)"),
}


def _usage() -> str:
    lines = ["usage: pagedkv COMMAND [ARGS...]   (pagedkv COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["  bench      benchmarks (print a table, write JSON):"]
    lines += [f"    {name:<10} {help_text}" for name, (_, help_text) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch `argv` to the subcommand's own `main(argv, prog)` and return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(_usage(), file=sys.stderr)
            print(f"pagedkv: error: unknown benchmark {rest[0] if rest else '(none)'!r}; "
                  f"choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
            return 2
        module_name, prog, rest = BENCHMARKS[rest[0]][0], f"pagedkv bench {rest[0]}", rest[1:]
    elif command in COMMANDS:
        module_name, prog = COMMANDS[command][0], f"pagedkv {command}"
    else:
        print(_usage(), file=sys.stderr)
        print(f"pagedkv: error: unknown command {command!r}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(module_name)
        return int(module.main(rest, prog=prog) or 0)
    except PagedKVError as error:
        print(f"pagedkv: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
