"""`pagedkv sim --chat-tiers`: how much host memory brings a multi-turn chat's time to first token down by how much.

The same conversations (`sim.chat_tiers.MultiTurnChat`: K system prompts, M conversations) run
once without prefix caching, once with the GPU prefix cache alone, and once per host-tier size
in `--host-memory`; every run has the same GPU pool. Printed per run: TTFT P50 and P99 (and
their ratio to GPU-only), output tokens/s and where prompt blocks came from. The copy
bandwidths are the cost model's `kv_tiers` (the packaged model says whether they were measured).
"""

from __future__ import annotations

import argparse
import json

from pagedkv.cli import parse_size
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.chat_tiers import MultiTurnChat, simulate_chat, tier_blocks
from pagedkv.sim.cost_model import CostModel


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError as error:
        raise InvalidArgumentError(f"--host-memory: {error}") from None


def add_chat_tiers_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--chat-tiers` option group of `pagedkv sim`."""
    group = parser.add_argument_group("KV tiers on multi-turn chat (--chat-tiers)")
    add = group.add_argument
    add("--chat-tiers", action="store_true", help="sweep host-tier sizes on a multi-turn chat workload")
    add("--chat-system-prompts", type=int, default=64, metavar="K", help="shared system prompts (default %(default)s)")
    add("--chat-conversations", type=int, default=128, metavar="M", help="conversations (default %(default)s)")
    add("--chat-turns", type=int, default=3, help="turns per conversation (default %(default)s)")
    add("--chat-concurrent", type=int, default=128, help="conversations live at once (default %(default)s)")
    add("--chat-system-len", type=int, default=1024, help="tokens per system prompt (default %(default)s)")
    # 64 x 64 system prompt blocks plus 128 histories of ~2 x 128 tokens: ~6,100 distinct prefix blocks
    add("--chat-gpu-blocks", type=int, default=600,
        help="GPU pool blocks of --block-size tokens (default %(default)s, about a tenth of the distinct prefix "
             "blocks of the default workload)")
    add("--host-memory", type=_sizes, default=_sizes("1GiB,4GiB,16GiB"), metavar="SIZES",
        help="host-tier sizes to try, comma-separated (default 1GiB,4GiB,16GiB)")


def run_chat_tiers(args: argparse.Namespace, cost: CostModel) -> int:
    """Run the sweep, print its table (or JSON), write sim_chat_tiers.json under --out."""
    workload = MultiTurnChat(num_system_prompts=args.chat_system_prompts, num_conversations=args.chat_conversations,
                             num_turns=args.chat_turns, num_concurrent=args.chat_concurrent,
                             system_prompt_tokens=args.chat_system_len, seed=args.seed)
    block_size = args.block_size
    max_model_len = max(args.max_model_len, workload.max_conversation_tokens)

    def config(prefix_caching: bool, host_bytes: int) -> SchedulerConfig:
        """The same GPU pool and limits for every run; only prefix caching and the host tier change."""
        return SchedulerConfig(num_blocks=args.chat_gpu_blocks, block_size=block_size, max_model_len=max_model_len,
                               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               watermark=args.watermark, enable_prefix_caching=prefix_caching,
                               num_offload_blocks=tier_blocks(host_bytes, cost, block_size))

    runs = [("no prefix cache", config(False, 0), 0), ("GPU only", config(True, 0), 0)]
    runs += [(f"GPU + {size / 2**30:g} GiB host", config(True, size), size) for size in args.host_memory]
    rows = []
    for name, run_config, host_bytes in runs:
        row = {"run": name, "host_memory_bytes": host_bytes, "host_blocks": run_config.num_offload_blocks,
               **simulate_chat(workload, run_config, cost)}
        rows.append(row)
    base = rows[1]
    for row in rows:
        row["ttft_p50_vs_gpu_only"] = base["ttft_p50_s"] / row["ttft_p50_s"] if row["ttft_p50_s"] else 0.0
        row["ttft_p99_vs_gpu_only"] = base["ttft_p99_s"] / row["ttft_p99_s"] if row["ttft_p99_s"] else 0.0
    bandwidths = (f"host->device {cost.h2d_bytes_per_s / 1e9:.0f} GB/s, device->host {cost.d2h_bytes_per_s / 1e9:.0f}"
                  f" GB/s ({'measured' if cost.tiers_measured else 'placeholders, not measured'})")
    payload = {"workload": workload.__dict__, "gpu_blocks": args.chat_gpu_blocks, "block_size": block_size,
               "cost_model": cost.constants(), "cost_model_source": cost.source,
               "tier_bandwidths_measured": cost.tiers_measured, "rows": rows}
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print(cost.describe())
        print(f"KV tiers: {bandwidths}, {cost.kv_bytes_per_token:,.0f} KV bytes per token")
        print(f"workload: {workload.num_conversations} conversations of {workload.num_turns} turns over "
              f"{workload.num_system_prompts} system prompts of {workload.system_prompt_tokens} tokens, "
              f"{workload.num_concurrent} live at once; GPU pool {args.chat_gpu_blocks} blocks of {block_size}")
        print()
        print(f"{'run':<24} {'TTFT P50':>9} {'TTFT P99':>9} {'P50 x':>6} {'P99 x':>6} {'out tok/s':>10} "
              f"{'prefill tok':>12} {'host hits':>10}")
        for row in rows:
            print(f"{row['run']:<24} {row['ttft_p50_s'] * 1e3:7.0f}ms {row['ttft_p99_s'] * 1e3:7.0f}ms "
                  f"{row['ttft_p50_vs_gpu_only']:5.2f}x {row['ttft_p99_vs_gpu_only']:5.2f}x "
                  f"{row['output_tokens_per_s']:10,.0f} {row['prefill_tokens']:12,} {row['host_hit_blocks']:10,}")
    from pagedkv.results import write_json

    path = write_json(args.out, "sim_chat_tiers", payload)
    if not args.json:
        print()
        print(f"wrote {path}")
    return 0
