"""The `pagedkv` command line: a thin argparse layer over typed functions.

Each subcommand is a `main(argv) -> int` in the module that owns the work, imported only
when that subcommand runs (so `pagedkv calc` never imports torch). Bad input of any kind
(argparse's own errors and every `PagedKVError`) becomes one line on stderr and exit status
2, with no traceback; Ctrl-C exits 130 quietly.

Helpers the subcommands share live here too: `ArgumentParser` (the one-line errors),
`parse_memory` / `parse_size` (sizes such as 512MiB) and `add_engine_arguments` (the engine
flags of both `generate` and `serve`).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from pagedkv.errors import InvalidArgumentError, PagedKVError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one `InvalidArgumentError` line (exit 2 via `main`), not a usage dump."""

    def error(self, message: str):
        raise InvalidArgumentError(message)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """A byte count: '1000000', '512MiB', '2GiB', '1.5GB' (KiB/MiB/GiB are powers of 2, KB/MB/GB of 10)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 512MiB, 2GiB or 1000000, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_memory(text: str) -> int | float:
    """`--kv-cache-memory`: a fraction of free memory ('0.5') or a size ('512MiB', '2GiB', '1000000')."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*", text)
    if match is not None and "." in text:
        return float(match.group(1))
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.5 or a size like 512MiB, got {text!r}") from None


def offload_options(args: argparse.Namespace) -> dict:
    """The KV tiers' `EngineConfig` fields from `add_engine_arguments`' flags."""
    return {"kv_offload_memory": args.kv_offload_memory, "kv_offload_dir": args.kv_offload_dir,
            "kv_offload_disk_bytes": args.kv_offload_disk_size,
            "kv_offload_in_step_restore_tokens": args.kv_offload_in_step_restore_tokens,
            "kv_offload_disk_writer": args.kv_offload_disk_writer,
            "kv_offload_early_restore": args.kv_offload_early_restore,
            "kv_offload_write_through": args.kv_offload_write_through}


def add_engine_arguments(group) -> None:
    """The engine flags `generate` and `serve` share: --device, --dtype, --block-size, --kv-cache-memory,
    --max-model-len, --kv-offload-memory, --kv-offload-dir, --kv-offload-disk-size,
    --kv-offload-disk-writer, --kv-offload-in-step-restore-tokens, --[no-]kv-offload-early-restore,
    --kv-offload-write-through, --kv-cache-dtype, --enforce-eager, --mixed-step-graphs."""
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    group.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: bf16 on CUDA)")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="GPUs that split one model (NCCL; gloo on CPU) (default %(default)s)")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas behind the prefix-aware router, one GPU each (default %(default)s)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    group.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                       help="KV pool budget: a fraction of free memory (0.5) or a size (512MiB) "
                            "(default: 0.5 on CUDA, 256MiB on CPU)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the model's limit, capped by the pool)")
    group.add_argument("--kv-offload-memory", type=parse_size, default=0, metavar="SIZE",
                       help="host memory for the KV tiers: prefixes the GPU evicts spill there and come back "
                            "by copy instead of prefill, e.g. 4GiB (default: off; see docs/kv-tiers.md)")
    group.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                       help="a disk tier behind the host tier (needs --kv-offload-memory); a restart on the same "
                            "DIR finds its prefixes again (default: off)")
    group.add_argument("--kv-offload-disk-size", type=parse_size, default=64 * 2**30, metavar="SIZE",
                       help="the disk tier's size cap, LRU beyond it (default 64GiB)")
    group.add_argument("--kv-offload-disk-writer", default="threads", choices=["threads", "process"],
                       help="who writes the disk tier's files: writer threads, or a writer process over a host "
                            "pool in shared memory that never takes the engine's interpreter lock "
                            "(default %(default)s)")
    group.add_argument("--kv-offload-in-step-restore-tokens", type=int, default=None, metavar="N",
                       help="tokens' worth of restored KV a step copies before its kernels, so that their requests "
                            "compute in it; the rest copy beside the step and compute from the next "
                            "(default: --max-num-batched-tokens; 0 for small models, whose KV copies nearly as "
                            "slowly as it computes)")
    group.add_argument("--kv-offload-early-restore", action=argparse.BooleanOptionalAction, default=True,
                       help="start a restore's host-to-device copies at admission, before the evictions and the "
                            "step's build (default; one rank only: under TP each rank copies with the step); "
                            "--no-kv-offload-early-restore issues them with the step's other block moves")
    group.add_argument("--kv-offload-write-through", action="store_true",
                       help="copy each prefix block to the host tier as soon as its KV is computed (up to 128 a "
                            "step, into free host blocks), so that evicting it later needs no copy "
                            "(experimental: not yet measured on a GPU)")
    from pagedkv.core.memory import KV_CACHE_DTYPES

    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="what the KV pool stores: the model's dtype (auto) or FP8, one byte per value "
                            "(twice the tokens in the same budget; scales from the checkpoint or a calibration "
                            "pass) (default %(default)s)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: every step launches its kernels from Python (slower; for debugging)")
    group.add_argument("--mixed-step-graphs", default="full", choices=["full", "piecewise", "off"],
                       help="CUDA graphs for steps with prefill tokens, per token bucket: full (attention inside, "
                            "one replay), piecewise (attention eager between graphs) or off (default %(default)s)")


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
    "parallel": ("pagedkv.bench.parallel", "tensor parallel, data-parallel replicas and routing (2+ GPUs)"),
    "latency": ("pagedkv.bench.latency", "decode step time at batch 1..256 against the roofline (GPU)"),
    "fp8": ("pagedkv.bench.fp8", "FP8 KV accuracy: perplexity and greedy agreement on SmolLM2 (CPU)"),
    "serve": ("pagedkv.bench.serve", "TTFT, TPOT, ITL and goodput of an OpenAI-compatible server under load"),
}


def _bench_usage() -> str:
    lines = ["usage: pagedkv bench NAME [ARGS...]   (pagedkv bench NAME --help for its options)", "",
             "benchmarks (print a table, write JSON):"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in BENCHMARKS.items()]
    return "\n".join(lines)


def _usage() -> str:
    lines = ["usage: pagedkv [--version] COMMAND [ARGS...]   (pagedkv COMMAND --help for its options)", "",
             "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["  bench      benchmarks (print a table, write JSON):"]
    lines += [f"    {name:<10} {help_text}" for name, (_, help_text) in BENCHMARKS.items()]
    return "\n".join(lines)


def _version() -> str:
    from pagedkv import __version__

    return f"pagedkv {__version__}"


def _resolve(argv: list[str]) -> tuple[str, str, list[str]] | int:
    """(module, prog, rest) of the subcommand `argv` names, or the exit status once usage is printed."""
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(_bench_usage())
            return 0
        if not rest or rest[0] not in BENCHMARKS:
            raise InvalidArgumentError(f"unknown benchmark {rest[0] if rest else '(none)'!r}; choose from "
                                       f"{', '.join(BENCHMARKS)} (pagedkv bench --help)")
        return BENCHMARKS[rest[0]][0], f"pagedkv bench {rest[0]}", rest[1:]
    if command == "serve" and "--ray" in rest:
        return "pagedkv.deploy.cli", "pagedkv serve", rest  # the same flags, served through Ray Serve
    if command in COMMANDS:
        return COMMANDS[command][0], f"pagedkv {command}", rest
    raise InvalidArgumentError(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}, bench "
                               f"(pagedkv --help)")


def main(argv: list[str] | None = None) -> int:
    """Dispatch `argv` to the subcommand's own `main(argv, prog)` and return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(_version())
        return 0
    try:
        resolved = _resolve(argv)
        if isinstance(resolved, int):
            return resolved
        module_name, prog, rest = resolved
        module = importlib.import_module(module_name)
        return int(module.main(rest, prog=prog) or 0)
    except PagedKVError as error:
        print(f"pagedkv: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
