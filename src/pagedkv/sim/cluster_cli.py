"""`pagedkv sim --cluster`: R replicas behind the router, routing policies compared, replicas sized.

    pagedkv sim --cluster                        the policies at --replicas on 1,000 Poisson requests, then
                                                 the fewest replicas meeting the P99 targets at --rate
                                                 (about 20 s on 2 cores; a progress bar on stderr);
                                                 writes <out>/cluster.json, .md and .png
    pagedkv sim --cluster --replicas 256 --no-sizing    one comparison at 256 replicas

The `pagedkv sim` options for the scheduler (--block-size, --max-num-seqs, --max-model-len,
--watermark, --preemption, --victim, --swap-blocks), --seed, --cost-model, --workers,
--json, --out and --tag apply; each replica's pool and step budget default to the measured
H200 engine's (benchmarks/results/engine.json). As with `pagedkv sim`, standard output
depends only on the arguments and the cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from pagedkv.distributed.router import DEFAULT_BALANCE_THRESHOLD, RouterConfig, RoutingPolicy
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import InvalidArgumentError, require_positive_int
from pagedkv.sim.chat_workload import ARRIVAL_PROCESSES, ChatWorkload
from pagedkv.sim.cluster import (
    DEFAULT_WARMUP_FRACTION,
    REPLICA_VIEWS,
    ClusterConfig,
    ClusterResult,
    ClusterTask,
    LatencyTarget,
    SizingResult,
    run_tasks,
)
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.sweep import default_workers

#: The baselines first, then the router's default.
ALL_POLICIES: tuple[str, ...] = (RoutingPolicy.ROUND_ROBIN.value, RoutingPolicy.LEAST_LOADED.value,
                                 RoutingPolicy.PREFIX.value)
# The measured engine's pool and step budget (Qwen3-0.6B shape, bf16, one H200).
DEFAULT_REPLICA_BLOCKS = 24184
DEFAULT_REPLICA_BATCHED_TOKENS = 8192
#: The default workload lasts one second of arrivals (1,000 requests at the default rate): the
#: default run (3 policies and 3 replica-count searches) then takes about 20 s on 2 cores.
DEFAULT_DURATION_S = 1.0


def _pair(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    return low, high


def _threshold(text: str) -> int | None:
    return None if text == "off" else int(text)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--cluster` option group of `pagedkv sim`."""
    group = parser.add_argument_group("cluster (--cluster)")
    add = group.add_argument
    add("--cluster", action="store_true", help="simulate replicas behind the data-parallel router")
    add("--replicas", type=int, default=6, help="replicas for the policy comparison (default %(default)s)")
    add("--rate", type=float, default=1000.0, help="mean arrival rate, requests/s (default %(default)s)")
    add("--requests", type=int, default=None, help=f"requests in all (default: rate x {DEFAULT_DURATION_S:g} s)")
    add("--arrival", default="poisson", help="poisson, bursty or both (default %(default)s)")
    add("--policy", default="all", help=f"{', '.join(ALL_POLICIES)} or all (default %(default)s)")
    add("--system-prompts", type=int, default=32, help="shared system prompts (default %(default)s)")
    add("--system-prompt-len", type=int, default=1000, help="tokens each (default %(default)s)")
    add("--zipf", type=float, default=1.0, help="Zipf exponent of their popularity (default %(default)s)")
    add("--user-tokens", type=_pair, default=(16, 256), metavar="MIN,MAX",
        help="user message tokens after the system prompt (default 16,256)")
    add("--output-tokens", type=_pair, default=(16, 256), metavar="MIN,MAX", help="generated tokens (default 16,256)")
    add("--p99-ttft", type=float, default=1.0, help="sizing target: P99 TTFT, s (default %(default)s)")
    add("--p99-e2e", type=float, default=10.0, help="sizing target: P99 end-to-end latency, s (default %(default)s)")
    add("--max-replicas", type=int, default=256, help="largest cluster sizing tries (default %(default)s)")
    add("--no-sizing", action="store_true", help="skip the replica-count search")
    add("--replica-blocks", type=int, default=DEFAULT_REPLICA_BLOCKS,
        help="KV blocks per replica (default %(default)s, the measured H200 engine's)")
    add("--replica-batched-tokens", type=int, default=DEFAULT_REPLICA_BATCHED_TOKENS,
        help="max_num_batched_tokens per replica (default %(default)s)")
    add("--balance-threshold", type=_threshold, default=DEFAULT_BALANCE_THRESHOLD,
        help="prefix policy: requests in flight over the least-busy replica's past which a prefix match is "
             "ignored, or 'off' (default %(default)s)")
    add("--replica-view", default="live", choices=REPLICA_VIEWS,
        help="what the router reads: live scheduler state with cache queries (in-process); the load a "
             "replica process published after its last step, no cache queries (DataParallelEngine); or that "
             "plus the requests sent since (default %(default)s)")
    add("--warmup", type=float, default=DEFAULT_WARMUP_FRACTION,
        help="share of the requests (the first to arrive) left out of the figures (default %(default)s)")


def _choices(value: str, every: tuple[str, ...], flag: str, all_word: str) -> tuple[str, ...]:
    if value == all_word:
        return every
    if value not in every:
        raise InvalidArgumentError(f"{flag} must be one of {', '.join(every)} or {all_word}; got {value!r}")
    return (value,)


def _workload(args: argparse.Namespace, arrival: str) -> ChatWorkload:
    num_requests = args.requests if args.requests is not None else max(1, round(args.rate * DEFAULT_DURATION_S))
    return ChatWorkload(num_requests=num_requests, rate_per_s=args.rate, arrival=arrival,
                        num_system_prompts=args.system_prompts, system_prompt_tokens=args.system_prompt_len,
                        zipf_exponent=args.zipf, min_user_tokens=args.user_tokens[0],
                        max_user_tokens=args.user_tokens[1], min_output_tokens=args.output_tokens[0],
                        max_output_tokens=args.output_tokens[1], seed=args.seed)


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    preemption = args.preemption or "recompute"
    return SchedulerConfig(num_blocks=args.replica_blocks, block_size=args.block_size,
                           max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.replica_batched_tokens, watermark=args.watermark,
                           preemption_mode=preemption, victim_policy=args.victim or "newest",
                           num_swap_blocks=args.swap_blocks if preemption == "swap" else 0)


def _check(args: argparse.Namespace, workloads: list[ChatWorkload]) -> None:
    for flag in ("replicas", "max_replicas", "replica_blocks", "replica_batched_tokens"):
        require_positive_int(f"--{flag.replace('_', '-')}", getattr(args, flag))
    if args.requests is not None:
        require_positive_int("--requests", args.requests)
    for flag, value in (("--p99-ttft", args.p99_ttft), ("--p99-e2e", args.p99_e2e)):
        if not value > 0:
            raise InvalidArgumentError(f"{flag} must be > 0, got {value}")
    longest = workloads[0].max_request_tokens
    if longest > args.max_model_len:
        raise InvalidArgumentError(f"the longest request (system {args.system_prompt_len} + user "
                                   f"{args.user_tokens[1]} + output {args.output_tokens[1]} = {longest} tokens) "
                                   f"exceeds --max-model-len {args.max_model_len}")


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.0f} ms"


def format_comparison(rows: list[dict]) -> str:
    """Policy comparison rows as a markdown table."""
    lines = ["| arrival | policy | replicas | tok/s | TTFT P50 | TTFT P99 | E2E P50 | E2E P99 | prefix hit | "
             "prefill tokens | preemptions | busiest replica |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['arrival']} | {row['policy']} | {row['num_replicas']} | {row['throughput_tokens_per_s']:,.0f} | "
            f"{_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} | {row['e2e_p50_s']:.2f} s | "
            f"{row['e2e_p99_s']:.2f} s | {row['prefix_hit_rate']:.1%} | {row['num_prefill_tokens']:,} | "
            f"{row['num_preemptions']} | {row['max_replica_load']:.2f}x mean |")
    return "\n".join(lines)


def format_sizing(rows: list[dict]) -> str:
    """Sizing rows as a markdown table."""
    lines = ["| arrival | policy | replicas needed | TTFT P99 | E2E P99 | prefix hit | tok/s per replica | runs |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        result = row["result"]
        tried = ", ".join(f"{p['num_replicas']}{'' if p['met'] else 'x'}" for p in row["probes"])
        if result is None:
            lines.append(f"| {row['arrival']} | {row['policy']} | > {row['max_replicas']} | - | - | - | - | {tried} |")
            continue
        lines.append(
            f"| {row['arrival']} | {row['policy']} | {row['num_replicas']} | {_ms(result['ttft_p99_s'])} | "
            f"{result['e2e_p99_s']:.2f} s | {result['prefix_hit_rate']:.1%} | "
            f"{result['throughput_tokens_per_s'] / row['num_replicas']:,.0f} | {tried} |")
    return "\n".join(lines)


def describe(args: argparse.Namespace, workload: ChatWorkload, scheduler: SchedulerConfig) -> str:
    """The workload and replica in two lines."""
    return (f"workload: {workload.num_requests} chat requests at {args.rate:g}/s ({args.arrival}), "
            f"{args.system_prompts} system prompts x {args.system_prompt_len} tokens (Zipf {args.zipf:g}), "
            f"user {args.user_tokens[0]}-{args.user_tokens[1]}, output {args.output_tokens[0]}-"
            f"{args.output_tokens[1]} tokens, seed {args.seed}, first {args.warmup:.0%} left out as warm-up\n"
            f"router: reads {args.replica_view} replica state, balance threshold {args.balance_threshold}\n"
            f"replica: {scheduler.num_blocks} blocks x {scheduler.block_size}, max_num_seqs {scheduler.max_num_seqs}, "
            f"max_num_batched_tokens {scheduler.max_num_batched_tokens}, max_model_len {scheduler.max_model_len}")


def plot_cluster(rows: list[dict], sizing: list[dict], path: Path, title: str) -> Path:
    """P99 TTFT, P99 E2E and prefix-hit rate per policy and arrival process, plus replicas needed; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ttft_p99_s", "P99 TTFT (s)", rows), ("e2e_p99_s", "P99 end-to-end (s)", rows),
              ("prefix_hit_rate", "prefix-hit rate", rows)]
    if sizing:
        panels.append(("num_replicas", "replicas needed", sizing))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (key, label, data) in zip(axes, panels):
        arrivals = list(dict.fromkeys(row["arrival"] for row in data))
        policies = list(dict.fromkeys(row["policy"] for row in data))
        width = 0.8 / len(policies)
        for i, policy in enumerate(policies):
            values = [next((row[key] or 0 for row in data if row["arrival"] == a and row["policy"] == policy), 0)
                      for a in arrivals]
            ax.bar([j + i * width for j in range(len(arrivals))], values, width, label=policy, color=f"C{i}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(arrivals))], arrivals)
        ax.set_title(label, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def _run_with_progress(tasks: list[ClusterTask], pairs: list[tuple[str, str]], args: argparse.Namespace,
                       target: LatencyTarget, cost_model: CostModel) -> list:
    """`run_tasks` with a progress bar and a line per finished search on stderr (stdout stays deterministic)."""
    from tqdm.auto import tqdm

    workers = args.workers or default_workers()
    num_searches = sum(task.target is not None for task in tasks)
    plan = f"{len(tasks) - num_searches} runs at {args.replicas} replicas"
    if num_searches:
        plan += (f" and {num_searches} replica-count searches (double from 1 replica until a run meets "
                 f"{target.describe()}, then bisect; at most {args.max_replicas})")
    print(f"sim --cluster: {plan}, in {min(workers, len(tasks))} processes", file=sys.stderr, flush=True)
    with tqdm(total=len(tasks), desc="simulations", unit="sim", file=sys.stderr) as bar:
        def on_done(index: int, result: ClusterResult | SizingResult) -> None:
            arrival, policy = pairs[index % len(pairs)]
            if isinstance(result, SizingResult):
                tried = ", ".join(f"{n}{'' if met else 'x'}" for n, met in result.probes)
                found = f"{result.num_replicas} replicas" if result.num_replicas else f"> {result.max_replicas}"
                bar.write(f"sizing {arrival}/{policy}: {found} (tried {tried}; x = missed)", file=sys.stderr)
            bar.update(1)

        return run_tasks(tasks, cost_model, workers=workers, on_done=on_done)


def run_cluster(args: argparse.Namespace, cost_model: CostModel) -> int:
    """`pagedkv sim --cluster` (see the module docstring)."""
    from pagedkv.results import provenance, write_json

    arrivals = _choices(args.arrival, ARRIVAL_PROCESSES, "--arrival", "both")
    policies = _choices(args.policy, ALL_POLICIES, "--policy", "all")
    workloads = {arrival: _workload(args, arrival) for arrival in arrivals}
    _check(args, list(workloads.values()))
    scheduler = _scheduler_config(args)
    target = LatencyTarget(args.p99_ttft, args.p99_e2e)

    def config(policy: str, num_replicas: int) -> ClusterConfig:
        return ClusterConfig(num_replicas, scheduler, RouterConfig(policy, balance_threshold=args.balance_threshold),
                             warmup_fraction=args.warmup, replica_view=args.replica_view)

    pairs = [(arrival, policy) for arrival in arrivals for policy in policies]
    # Searches first: they take longest, so the processes finish together.
    tasks = [] if args.no_sizing else [ClusterTask(config(p, 1), workloads[a], target, args.max_replicas)
                                       for a, p in pairs]
    tasks += [ClusterTask(config(p, args.replicas), workloads[a]) for a, p in pairs]
    started = time.perf_counter()
    results = _run_with_progress(tasks, pairs, args, target, cost_model)
    wall_s = time.perf_counter() - started
    searches = [r for r in results if isinstance(r, SizingResult)]
    runs = [r for r in results if isinstance(r, ClusterResult)]
    rows = [{"arrival": a, **r.to_dict()} for (a, _), r in zip(pairs, runs)]
    sizing = [{"arrival": a, **s.to_dict()} for (a, _), s in zip(pairs, searches)]

    payload = {
        "workloads": {a: dataclasses.asdict(w) for a, w in workloads.items()},
        "replica": {"num_blocks": scheduler.num_blocks, "block_size": scheduler.block_size,
                    "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                    "max_model_len": scheduler.max_model_len, "watermark": scheduler.watermark,
                    "preemption_mode": scheduler.preemption_mode.value},
        "router": {"balance_threshold": args.balance_threshold, "replica_view": args.replica_view},
        "warmup_fraction": args.warmup,
        "target": target.describe(),
        "cost_model": cost_model.constants(),
        "cost_model_source": cost_model.source,
        "comparison": rows,
        "sizing": sizing,
    }
    text = [cost_model.describe(), describe(args, next(iter(workloads.values())), scheduler), "",
            f"Routing policies at {args.replicas} replicas:", "", format_comparison(rows)]
    if sizing:
        text += ["", f"Replicas needed for {args.rate:g} requests/s at {target.describe()} "
                     f"(runs: replicas tried, x = missed):", "", format_sizing(sizing)]
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print("\n".join(text))
    name = f"cluster_{args.tag}" if args.tag else "cluster"
    json_path = write_json(args.out, name,
                           {**payload, "wall_s": wall_s, "provenance": provenance("simulated (cost model)")})
    json_path.with_suffix(".md").write_text("# Cluster simulation (`pagedkv sim --cluster`)\n\n"
                                            + "\n".join(text) + "\n")
    png_path = plot_cluster(rows, sizing, json_path.with_suffix(".png"),
                            f"pagedkv sim --cluster: {args.rate:g} req/s, {args.replicas} replicas; sizing for "
                            f"{target.describe()}")
    if not args.json:
        print()
        print(f"wrote {json_path}, {json_path.with_suffix('.md')} and {png_path}")
    return 0
