"""`pagedkv bench engine --preset chat-tiers`: KV tiers on a multi-turn chat workload, and a restart.

The conversations of `pagedkv.sim.chat_tiers` (K system prompts, M conversations of a few turns,
every conversation live: its next turn is sent when its answer is back, greedy, the answer part of
the history) run through the real engine three times, on the same GPU pool, sized to hold about a
tenth of the live conversations' prefixes:

    no prefix cache      every turn computes its whole prompt
    GPU only             the GPU prefix cache alone
    GPU + host + disk    --kv-offload-memory and a --kv-offload-dir behind it

Reported per configuration: TTFT P50/P99, output tok/s, where prompt blocks came from (hit rate
per tier over the blocks that could hit), the KV copies' bytes and device time; and the pinned
copy bandwidth measured in the same run (one large pinned <-> device copy each way), against
which the restore rate (restored bytes / their device time) is set. Then a restart: the tiers'
engine shuts down (writing its cache to disk), a new engine opens the same directory and serves
the last turns of the last conversations again: the share of prompt blocks served from disk and
the first request's TTFT. A benchmark: it prints and writes JSON and markdown, and never asserts.
`--smoke` runs the same code on the CPU at toy size.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from pagedkv.results import provenance, write_json
from pagedkv.sim.chat_tiers import Conversations, MultiTurnChat
from pagedkv.sim.cluster import percentile

#: Per model: (conversations, system prompts, turns, system prompt tokens, max_num_seqs).
SIZES = {"qwen3-0.6b": (96, 8, 3, 1024, 8), "llama3-8b": (48, 4, 3, 1024, 4)}
SMOKE_SIZE = (12, 3, 2, 48, 2)
#: The disk tier's size cap in this benchmark (the H200 machine's disk is 64 GiB).
DISK_CAP_BYTES = 12 * 2**30


def pinned_bandwidth(device: torch.device, nbytes: int = 512 * 2**20) -> dict:
    """Bytes/s of one pinned host -> device and one device -> host copy of `nbytes` (best of 3 each)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for name, dst, src in (("h2d_bytes_per_s", dev, host), ("d2h_bytes_per_s", host, dev)):
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        result[name] = nbytes / best
    return result


def run_chat(engine, workload: MultiTurnChat) -> dict:
    """Every conversation through `engine`, closed loop; TTFT per turn, output tok/s, the prompts sent."""
    from pagedkv.engine.sampling_params import SamplingParams

    conversations = Conversations(workload)
    engine.stream_outputs = True
    submitted: dict[str, tuple[int, float]] = {}
    ttft: dict[str, float] = {}
    prompts: dict[str, list[int]] = {}
    num_output_tokens = 0
    turns: dict[int, int] = {}

    def submit(turn) -> None:
        """Send one turn (greedy, its drawn answer length) and note when."""
        conversation, prompt, answer_len = turn
        request_id = f"c{conversation}-t{turns.get(conversation, 0)}"
        turns[conversation] = turns.get(conversation, 0) + 1
        prompts[request_id] = prompt
        submitted[request_id] = (conversation, time.perf_counter())
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=answer_len,
                                                              ignore_eos=True))

    start = time.perf_counter()
    for turn in conversations.start():
        submit(turn)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            tokens = output.outputs[0].token_ids
            if output.request_id not in ttft and tokens:
                ttft[output.request_id] = now - submitted[output.request_id][1]
            if output.finished:
                num_output_tokens += len(tokens)
                follow_up = conversations.answered(submitted[output.request_id][0], list(tokens))
                if follow_up is not None:
                    submit(follow_up)
    elapsed = time.perf_counter() - start
    values = list(ttft.values())
    return {"elapsed_s": elapsed, "num_requests": len(values), "num_output_tokens": num_output_tokens,
            "output_tokens_per_s": num_output_tokens / elapsed, "ttft_p50_s": percentile(values, 50),
            "ttft_p99_s": percentile(values, 99), "ttft_mean_s": sum(values) / len(values), "prompts": prompts}


def _tier_summary(stats: dict, block_size: int, prompts: dict) -> dict:
    """Hit rates per tier over the prompt blocks that could hit, and the copies' bytes, times and rates."""
    hittable = sum((len(p) - 1) // block_size for p in prompts.values())
    summary = {"hittable_blocks": hittable, "prefix_hit_tokens": stats["prefix_cache_hit_tokens"]}
    for tier in ("gpu", "host", "disk"):
        summary[f"{tier}_hit_rate"] = stats.get(f"kv_{tier}_hit_blocks", 0) / hittable if hittable else 0.0
    if not stats.get("kv_host_blocks"):
        summary["gpu_hit_rate"] = stats["prefix_cache_hit_tokens"] / block_size / hittable if hittable else 0.0
    for key in ("kv_offloaded_blocks", "kv_restored_blocks", "kv_disk_written_blocks", "kv_disk_load_misses",
                "kv_d2h_bytes", "kv_d2h_seconds", "kv_h2d_bytes", "kv_h2d_seconds", "kv_disk_read_bytes",
                "kv_disk_read_seconds", "num_preemptions"):
        summary[key] = stats.get(key, 0)
    summary["restore_bytes_per_s"] = stats["kv_h2d_bytes"] / stats["kv_h2d_seconds"] if stats.get(
        "kv_h2d_seconds") else None
    return summary


def run_model(name: str, args, device: torch.device, offload_dir: Path) -> dict:
    """The three configurations and the restart for one model shape."""
    from pagedkv.engine.llm import LLM
    from pagedkv.models.loader import random_model

    smoke = args.smoke
    conversations, systems, num_turns, system_len, max_num_seqs = SMOKE_SIZE if smoke else SIZES.get(
        name, SIZES["qwen3-0.6b"])
    dtype = torch.float32 if smoke else torch.bfloat16
    model = random_model(name, dtype, device)
    workload = MultiTurnChat(num_system_prompts=systems, num_conversations=conversations, num_turns=num_turns,
                             num_concurrent=conversations, system_prompt_tokens=system_len,
                             min_user_tokens=8 if smoke else 32, max_user_tokens=16 if smoke else 128,
                             min_output_tokens=4 if smoke else 16, max_output_tokens=8 if smoke else 48,
                             vocab_size=min(model.config.get_text_config().vocab_size, 32000))
    block_size = 16
    mean_turn = (workload.min_user_tokens + workload.max_user_tokens + workload.min_output_tokens
                 + workload.max_output_tokens) / 2
    live_prefix_tokens = conversations * (system_len + mean_turn * (num_turns - 1) / 2)
    batch_tokens = max_num_seqs * workload.max_conversation_tokens
    num_blocks = int(max(0.1 * live_prefix_tokens, 1.2 * batch_tokens) // block_size)
    host_bytes = args.kv_offload_memory or (64 * 2**20 if smoke else 16 * 2**30)
    # Prefill and mixed steps run eagerly (decode steps replay graphs): eight engines start in this run, and
    # capturing the piecewise graphs of each would take most of its time. The same in every configuration.
    common = dict(hf_model=model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                  max_model_len=workload.max_conversation_tokens, max_num_batched_tokens=4096,
                  mixed_step_graphs="off")
    # The disk tier's cap keeps a run inside a small disk; LRU keeps what the restart replays (the latest turns).
    disk_bytes = 64 * 2**20 if smoke else DISK_CAP_BYTES
    configs = [("no prefix cache", dict(enable_prefix_caching=False)), ("GPU only", {}),
               ("GPU + host + disk", dict(kv_offload_memory=host_bytes, kv_offload_dir=str(offload_dir),
                                          kv_offload_disk_bytes=disk_bytes))]
    result = {"workload": workload.__dict__, "num_blocks": num_blocks, "block_size": block_size,
              "live_prefix_tokens": live_prefix_tokens, "gpu_pool_share_of_live_prefixes":
                  num_blocks * block_size / live_prefix_tokens, "host_bytes": host_bytes, "configs": {}}
    if device.type == "cuda":
        result["pinned_bandwidth"] = pinned_bandwidth(device)
    tiered = None
    for label, options in configs:
        llm = LLM(**common, **options)
        run_chat(llm.engine, MultiTurnChat(**{**workload.__dict__, "num_conversations": 2, "num_concurrent": 2,
                                              "seed": workload.seed + 1}))  # warm-up: kernels, graphs
        stats_before = llm.stats()
        run = run_chat(llm.engine, workload)
        stats = {k: v - stats_before.get(k, 0) if isinstance(v, (int, float)) else v for k, v in llm.stats().items()}
        prompts = run.pop("prompts")
        result["configs"][label] = {**run, **_tier_summary(stats, block_size, prompts),
                                    "prompts_hash": hash(tuple(tuple(p) for p in prompts.values()))}
        print(f"{name} | {label}: TTFT P50 {run['ttft_p50_s'] * 1e3:.1f} ms, P99 {run['ttft_p99_s'] * 1e3:.1f} ms, "
              f"{run['output_tokens_per_s']:,.0f} output tok/s", flush=True)
        if options.get("kv_offload_dir"):
            tiered = (llm, prompts)
        else:
            llm.shutdown()
            del llm
    llm, prompts = tiered
    llm.shutdown()  # writes what is only on the GPU and in host memory
    del llm
    result["restart"] = restart(LLM, common, configs[2][1], workload, prompts, block_size)
    shutil.rmtree(offload_dir, ignore_errors=True)
    print(f"{name} | restart: {result['restart']['disk_share'] * 100:.1f}% of prompt blocks read from disk, "
          f"{result['restart']['not_computed_share'] * 100:.1f}% not computed, first TTFT "
          f"{result['restart']['first_ttft_s'] * 1e3:.1f} ms", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def restart(LLM, common: dict, options: dict, workload: MultiTurnChat, prompts: dict, block_size: int) -> dict:
    """A new engine on the same directory serves the last turns of the last conversations again."""
    from pagedkv.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(**common, **options)
    startup_s = time.perf_counter() - start
    last = f"-t{workload.num_turns - 1}"
    replay = [p for rid, p in prompts.items() if rid.endswith(last)][-8:]  # the latest: what the LRU cap keeps
    engine = llm.engine
    engine.stream_outputs = True
    ttfts = []
    for index, prompt in enumerate(replay):  # one at a time: each TTFT is a cold engine's
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        begin = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - begin
        ttfts.append(first)
    stats = llm.stats()
    hittable = sum((len(p) - 1) // block_size for p in replay)
    llm.shutdown()
    return {"startup_s": startup_s, "num_requests": len(replay), "hittable_blocks": hittable,
            "disk_hit_blocks": stats["kv_disk_hit_blocks"], "gpu_hit_blocks": stats["kv_gpu_hit_blocks"],
            "disk_share": stats["kv_disk_hit_blocks"] / hittable if hittable else 0.0,
            # a block loaded from disk once is then shared on the GPU by the next prompt with that prefix
            "not_computed_share": (stats["kv_disk_hit_blocks"] + stats["kv_gpu_hit_blocks"]
                                   + stats["kv_host_hit_blocks"]) / hittable if hittable else 0.0,
            "disk_load_misses": stats["kv_disk_load_misses"], "first_ttft_s": ttfts[0] if ttfts else None,
            "ttft_s": ttfts, "disk_read_seconds": stats["kv_disk_read_seconds"]}


def markdown(result: dict) -> str:
    """The results as markdown tables."""
    lines = [f"# KV tiers on multi-turn chat ({result['provenance'].get('device')}, {result['provenance']['date']}, "
             f"commit {result['provenance']['commit']})", ""]
    for name, model in result["models"].items():
        w = model["workload"]
        lines += [f"## random:{name}: {w['num_conversations']} conversations x {w['num_turns']} turns over "
                  f"{w['num_system_prompts']} system prompts of {w['system_prompt_tokens']} tokens; GPU pool "
                  f"{model['num_blocks']} blocks ({model['gpu_pool_share_of_live_prefixes'] * 100:.0f}% of live "
                  f"prefixes), host tier {model['host_bytes'] / 2**30:g} GiB; prefill steps eager, decode steps "
                  f"graphed, in every configuration", "",
                  "| config | TTFT P50 ms | TTFT P99 ms | output tok/s | GPU hits | host hits | disk hits | "
                  "restored GB | restore GB/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for label, row in model["configs"].items():
            rate = row["restore_bytes_per_s"]
            lines.append(f"| {label} | {row['ttft_p50_s'] * 1e3:.1f} | {row['ttft_p99_s'] * 1e3:.1f} | "
                         f"{row['output_tokens_per_s']:,.0f} | {row['gpu_hit_rate'] * 100:.0f}% | "
                         f"{row['host_hit_rate'] * 100:.0f}% | {row['disk_hit_rate'] * 100:.0f}% | "
                         f"{row['kv_h2d_bytes'] / 1e9:.2f} | {'-' if rate is None else f'{rate / 1e9:.1f}'} |")
        gpu, tiers = model["configs"]["GPU only"], model["configs"]["GPU + host + disk"]
        lines.append("")
        lines.append(f"TTFT vs GPU-only: P50 {gpu['ttft_p50_s'] / tiers['ttft_p50_s']:.2f}x lower, P99 "
                     f"{gpu['ttft_p99_s'] / tiers['ttft_p99_s']:.2f}x lower (target >= 3x); output tok/s "
                     f"{tiers['output_tokens_per_s'] / gpu['output_tokens_per_s']:.2f}x (target >= 1x)")
        if "pinned_bandwidth" in model:
            pinned = model["pinned_bandwidth"]["h2d_bytes_per_s"]
            rate = tiers["restore_bytes_per_s"]
            lines.append(f"Pinned copy bandwidth in this run: H2D {pinned / 1e9:.1f} GB/s, D2H "
                         f"{model['pinned_bandwidth']['d2h_bytes_per_s'] / 1e9:.1f} GB/s; restore rate "
                         f"{'-' if rate is None else f'{rate / pinned * 100:.0f}%'} of H2D (target >= 80%)")
        r = model["restart"]
        lines.append(f"Restart: {r['disk_share'] * 100:.1f}% of prompt blocks read from disk, "
                     f"{r['not_computed_share'] * 100:.1f}% not computed (read from disk, or shared on the GPU "
                     f"after another prompt read them; target >= 90%), {r['disk_load_misses']} bad files, first "
                     f"request TTFT {r['first_ttft_s'] * 1e3:.1f} ms, engine startup {r['startup_s']:.1f} s")
        lines.append("")
    return "\n".join(lines)


def run(args) -> int:
    """Run every model in `args.model` (comma-separated); print; write kv_tiers.json and kv_tiers.md to --out."""
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke:
        from pagedkv.bench.common import require_cuda

        require_cuda("pagedkv bench engine --preset chat-tiers", "--smoke runs it on the CPU at toy size")
    names = ["tiny-llama"] if args.smoke else [n.strip() for n in args.model.split(",") if n.strip()]
    result = {"benchmark": "engine chat-tiers", "smoke": args.smoke,
              "provenance": provenance(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
              "models": {}}
    with tempfile.TemporaryDirectory(prefix="pagedkv-kv-tiers-") as scratch:
        for name in names:
            directory = Path(args.kv_offload_dir or scratch) / name
            result["models"][name] = run_model(name, args, device, directory)
    write_json(args.out, "kv_tiers", result)
    text = markdown(result)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kv_tiers.md").write_text(text + "\n")
    print(text)
    return 0
