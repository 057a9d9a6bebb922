"""`pagedkv bench engine --preset chat-tiers`: KV tiers on a multi-turn chat workload, and a restart.

The conversations of `pagedkv.sim.chat_tiers` (K system prompts, M conversations of a few turns,
greedy, an answer part of each history) run through the real engine three times, on the same GPU
pool, sized to hold about a tenth of the distinct prefix blocks the conversations reuse:

    no prefix cache      every turn computes its whole prompt
    GPU only             the GPU prefix cache alone
    GPU + host + disk    --kv-offload-memory and a --kv-offload-dir behind it

Every configuration serves the same prompts in the same order (`MultiTurnChat.fixed_turns`): turn
by turn across the conversations, each history holding fixed answers drawn from the seed rather
than the generated tokens (which differ between configurations: batches of other shapes round
differently in bf16), each answer `ignore_eos` with its drawn length. `max_num_seqs` turns are in
flight at a time (a closed loop at fixed concurrency: a turn is sent when a slot frees), so no turn
queues inside the engine, and TTFT is what a turn's own prefill or restore costs beside the turns
running with it; between two turns of one conversation the other conversations' turns push its
prefix out of the GPU pool.

Before the configurations, a warm-up pass runs the whole workload of another seed through the
tiers once: Triton compiles a kernel per launch specialization the first time a step needs it (up
to a second or more each), and short queries over restored prefixes need some that the other
configurations never do, so without it the compiles land inside one configuration's measured run.

Reported per configuration: TTFT P50/P99, output tok/s, where prompt blocks came from (hit rate
per tier over the blocks that could hit), the KV copies' bytes and device time, and the steps'
host time per phase (`LLMEngine.step_timings`) with the slowest steps and their shapes. The restore rate
is set against the pinned copy bandwidth measured in the same run (one large pinned <-> device
copy each way) twice: the host -> device copies alone, and with the scatter into the pool. What
TTFT gain is possible at all is measured too: one turn's prefill of a typical prefix plus user
message, against copying that prefix at the measured bandwidth plus the user message's prefill.
Then a restart: the tiers' engine shuts down (writing its cache to disk), a new engine opens the
same directory and serves the last turns of the last conversations again, one at a time: per
distinct prompt block, the share read from disk and the share not computed (read from disk, or
shared on the GPU after a prompt read it), and the first request's TTFT. A benchmark: it prints
and writes JSON and markdown, and never asserts. `--smoke` runs the same code on the CPU at toy
size.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pagedkv.core.prefix_cache import hash_blocks
from pagedkv.bench.chat_tiers_report import (
    HOST_ONLY,
    LATE_RESTORE,
    TIERED,
    WRITE_THROUGH,
    WRITER_PROCESS,
    WRITES_DURING_STEPS,
    in_step_label,
    markdown,
    step_line,
)
from pagedkv.bench.chat_tiers_run import run_chat
from pagedkv.results import provenance, write_json
from pagedkv.sim.chat_tiers import MultiTurnChat


@dataclasses.dataclass(frozen=True)
class ExtraConfig:
    """An optional configuration of the bench: the tiered one with some engine options changed, run when
    `pagedkv bench engine` gets `flag`."""

    flag: str
    label: str  # its row in the report
    help: str
    disk: str | None  # its disk tier's subdirectory (each configuration a disk of its own); None: no disk tier
    overrides: tuple[tuple[str, object], ...] = ()  # EngineConfig fields over the tiered configuration's

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def options(self, tiered: dict, offload_dir: Path) -> dict:
        """The engine options: `tiered`'s host tier, a disk of its own (or none), then the overrides."""
        if self.disk is None:
            base = {"kv_offload_memory": tiered["kv_offload_memory"]}
        else:
            base = dict(tiered, kv_offload_dir=str(Path(offload_dir) / self.disk))
        return dict(base, **dict(self.overrides))


EXTRA_CONFIGS = (
    ExtraConfig("--host-tier-only", HOST_ONLY, "the same host tier without the disk tier (what the disk writers "
                "cost the steps)", None),
    ExtraConfig("--disk-writes-during-steps", WRITES_DURING_STEPS, "the tiers with disk writes free to start while "
                "the step loop schedules and launches (kv_offload_disk_writes_during_steps)", "during",
                (("kv_offload_disk_writes_during_steps", True),)),
    ExtraConfig("--disk-writer-process", WRITER_PROCESS, "the tiers with the disk writes in a child process over a "
                "shared host pool (kv_offload_disk_writer=\"process\")", "process",
                (("kv_offload_disk_writer", "process"),)),
    ExtraConfig("--late-restore", LATE_RESTORE, "the tiers with each restore's copies issued with the step's other "
                "block moves instead of at admission (kv_offload_early_restore=False)", "late",
                (("kv_offload_early_restore", False),)),
    ExtraConfig("--write-through", WRITE_THROUGH, "the tiers copying each committed block to the host ahead of any "
                "eviction (kv_offload_write_through)", "write-through", (("kv_offload_write_through", True),)),
)

def extra_configs(args, tiered: dict, offload_dir: Path) -> list[tuple[str, dict]]:
    """(label, engine options) of each optional configuration whose switch `args` has on, in table order."""
    return [(extra.label, extra.options(tiered, offload_dir)) for extra in EXTRA_CONFIGS if getattr(args, extra.dest)]


#: Per model: (conversations, system prompts, turns, system prompt tokens, max_num_seqs).
SIZES = {"qwen3-0.6b": (128, 64, 3, 1024, 4), "llama3-8b": (96, 48, 3, 1024, 4)}
SMOKE_SIZE = (12, 6, 2, 48, 2)
#: The disk tier's size cap in this benchmark, or the host tier's size if larger (a disk tier smaller than the host
#: tier could not keep what the host holds; the H200 machine's disk is 64 GiB).
DISK_CAP_BYTES = 12 * 2**30
#: The host-to-device bandwidth a CPU smoke run prices copies at (the H200's, pinned; nothing is measured).
SMOKE_H2D_BYTES_PER_S = 55e9


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


def hittable_keys(prompt: list[int], block_size: int) -> list[bytes]:
    """Keys of the prompt blocks a cache could serve (never the block of the last prompt token)."""
    return hash_blocks(prompt, block_size)[:(len(prompt) - 1) // block_size]


def _tier_summary(stats: dict, block_size: int, block_nbytes: int, prompts: dict, tiered: bool) -> dict:
    """Hit rates per tier over the prompt blocks that could hit, and the copies' bytes, times and rates.

    `stats` are the run's differences, so gauges read 0: `tiered` says whether the KV tiers count hits."""
    hittable = sum((len(p) - 1) // block_size for p in prompts.values())
    summary = {"hittable_blocks": hittable, "prefix_hit_tokens": stats["prefix_cache_hit_tokens"]}
    for tier in ("gpu", "host", "disk"):
        summary[f"{tier}_hit_rate"] = stats.get(f"kv_{tier}_hit_blocks", 0) / hittable if hittable else 0.0
    if not tiered:  # the GPU prefix cache's own count (with tiers it also counts the restored blocks)
        summary["gpu_hit_rate"] = stats["prefix_cache_hit_tokens"] / block_size / hittable if hittable else 0.0
    for key in ("kv_offloaded_blocks", "kv_restored_blocks", "kv_disk_written_blocks", "kv_disk_load_misses",
                "kv_d2h_bytes", "kv_d2h_seconds", "kv_h2d_bytes", "kv_h2d_seconds", "kv_h2d_copy_seconds",
                "kv_h2d_num_copies", "kv_disk_read_bytes", "kv_disk_read_seconds", "kv_disk_write_waits",
                "kv_disk_write_wait_seconds", "num_preemptions"):
        summary[key] = stats.get(key, 0)
    h2d_bytes = stats.get("kv_h2d_bytes", 0)
    summary["restore_bytes_per_s"] = h2d_bytes / stats["kv_h2d_seconds"] if stats.get("kv_h2d_seconds") else None
    summary["restore_copy_bytes_per_s"] = (h2d_bytes / stats["kv_h2d_copy_seconds"]
                                           if stats.get("kv_h2d_copy_seconds") else None)
    summary["blocks_per_h2d_copy"] = (h2d_bytes / block_nbytes / stats["kv_h2d_num_copies"]
                                      if stats.get("kv_h2d_num_copies") else None)
    return summary


def _prefill_s(engine, tokens: list[int]) -> float:
    """Seconds from sending `tokens` (alone, max_tokens=1) to its first token."""
    from pagedkv.engine.sampling_params import SamplingParams

    engine.add_request(f"probe-{time.perf_counter_ns()}", tokens, SamplingParams(temperature=0.0, max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def restore_bound(engine, workload: MultiTurnChat, block_size: int, h2d_bytes_per_s: float) -> dict:
    """What restoring can win at most for one typical turn: its prefill against copying its prefix plus the
    prefill of its user message (best of 3 each, fresh tokens, an idle engine)."""
    prefix_tokens = workload.system_prompt_tokens + (workload.min_user_tokens + workload.max_user_tokens
                                                     + workload.min_output_tokens + workload.max_output_tokens) // 2
    prefix_tokens -= prefix_tokens % block_size  # what a cache can hold: whole blocks
    user_tokens = (workload.min_user_tokens + workload.max_user_tokens) // 2
    generator = torch.Generator().manual_seed(workload.seed)

    def fresh(n: int) -> list[int]:
        return torch.randint(1, workload.vocab_size, (n,), generator=generator).tolist()

    full_s = min(_prefill_s(engine, fresh(prefix_tokens + user_tokens)) for _ in range(3))
    user_s = min(_prefill_s(engine, fresh(user_tokens)) for _ in range(3))
    copy_s = prefix_tokens // block_size * engine.pool.bytes_per_block / h2d_bytes_per_s
    return {"prefix_tokens": prefix_tokens, "user_tokens": user_tokens, "prefill_s": full_s, "user_prefill_s": user_s,
            "copy_s": copy_s, "h2d_bytes_per_s": h2d_bytes_per_s, "max_ttft_gain": full_s / (copy_s + user_s),
            "recompute_over_copy": max(full_s - user_s, 0.0) / copy_s}


def profiled(call, path: Path):
    """`call()` under cProfile; its pagedkv functions by own time, then by cumulative time, written to `path`."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(call)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(r"pagedkv", 40)
    path.write_text(text.getvalue())
    return result


def torch_profiled(call, path: Path):
    """`call()` under torch.profiler: ops and CUDA runtime calls by their own host time (a call that blocks the
    step loop on the device shows there), and on CUDA by device time, written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])) as prof:
        result = call()
    table = prof.key_averages()
    text = table.table(sort_by="self_cpu_time_total", row_limit=40)
    if on_cuda:
        text += "\n" + table.table(sort_by="self_device_time_total", row_limit=25)
    path.write_text(text)
    return result


def warm_kernels(llm, workload: MultiTurnChat, max_in_flight: int) -> float:
    """Run `workload` (another seed's conversations) through `llm` (GPU + host tier), then two of its last turns
    alone, and shut it down; the seconds it took.

    Triton compiles a kernel per launch specialization (query tile height, split count, ...) the first time a
    step needs it, which takes up to a second or more. The turns of every configuration need some of them first:
    full prompts on a miss, short queries over restored prefixes with the tiers, a lone prompt cached to its
    last block after a restart. Compiled here, once per process, they stay out of every measured run."""
    start = time.perf_counter()
    turns = workload.fixed_turns()
    run_chat(llm.engine, turns, max_in_flight)
    last = [turn for turn in turns if turn[1] == workload.num_turns - 1][-2:]
    for index, (_, _, prompt, answer_len) in enumerate(last):  # its prefix is cached: the last block's query
        run_chat(llm.engine, [(-1 - index, 0, prompt, answer_len)], 1)
    llm.shutdown()
    return time.perf_counter() - start


def chat_workload(size: tuple[int, int, int, int], model, smoke: bool = False) -> MultiTurnChat:
    """The bench's chat of `size` (conversations, system prompts, turns, system prompt tokens) for `model`:
    32-128-token messages, 8-24-token answers (shorter in a smoke run)."""
    conversations, systems, num_turns, system_len = size
    return MultiTurnChat(num_system_prompts=systems, num_conversations=conversations, num_turns=num_turns,
                         num_concurrent=conversations, system_prompt_tokens=system_len,
                         min_user_tokens=8 if smoke else 32, max_user_tokens=16 if smoke else 128,
                         min_output_tokens=4 if smoke else 8, max_output_tokens=8 if smoke else 24,
                         vocab_size=min(model.config.get_text_config().vocab_size, 32000))


def chat_pool_blocks(workload: MultiTurnChat, max_num_seqs: int, block_size: int) -> int:
    """The GPU pool for `workload`: ~10% of what a cache could reuse by the last turn (each system prompt once,
    and every conversation's history), at least the running turns with some room."""
    mean_turn = (workload.min_user_tokens + workload.max_user_tokens + workload.min_output_tokens
                 + workload.max_output_tokens) / 2
    prefix_tokens_estimate = (workload.num_system_prompts * workload.system_prompt_tokens
                              + workload.num_conversations * mean_turn * (workload.num_turns - 1))
    batch_tokens = max_num_seqs * workload.max_conversation_tokens  # the running turns must fit
    return int(max(0.1 * prefix_tokens_estimate, 1.2 * batch_tokens) // block_size)


def run_model(name: str, args, device: torch.device, offload_dir: Path) -> dict:
    """The three configurations, the restore bound and the restart for one model shape."""
    from pagedkv.engine.llm import LLM
    from pagedkv.models.loader import random_model

    smoke = args.smoke
    conversations, systems, num_turns, system_len, max_num_seqs = SMOKE_SIZE if smoke else (
        args.chat_size or SIZES.get(name, SIZES["qwen3-0.6b"]))
    dtype = torch.float32 if smoke else torch.bfloat16
    model = random_model(name, dtype, device)
    workload = chat_workload((conversations, systems, num_turns, system_len), model, smoke)
    block_size = 16
    num_blocks = chat_pool_blocks(workload, max_num_seqs, block_size)
    host_bytes = args.kv_offload_memory or (64 * 2**20 if smoke else 16 * 2**30)
    # Steps with prefill tokens replay graphs as the engine's default does (--mixed-step-graphs off: eagerly, so
    # that the run's eight engines start faster); the same in every configuration.
    common = dict(hf_model=model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                  max_model_len=workload.max_conversation_tokens, max_num_batched_tokens=4096,
                  mixed_step_graphs=args.mixed_step_graphs)
    # The disk tier's cap keeps a run inside a small disk; LRU keeps what the restart replays (the latest turns).
    disk_bytes = 64 * 2**20 if smoke else max(DISK_CAP_BYTES, host_bytes)
    tiered = dict(kv_offload_memory=host_bytes, kv_offload_dir=str(offload_dir), kv_offload_disk_bytes=disk_bytes)
    configs = [("no prefix cache", dict(enable_prefix_caching=False)), ("GPU only", {}), (TIERED, tiered)]
    configs += extra_configs(args, tiered, offload_dir)
    if args.in_step_restore_tokens is not None:  # the same tiers, restores moved beside the step (a disk of its own)
        configs.append((in_step_label(args.in_step_restore_tokens),
                        dict(tiered, kv_offload_dir=str(Path(offload_dir) / "in-step"),
                             kv_offload_in_step_restore_tokens=args.in_step_restore_tokens)))
    result = {"workload": workload.__dict__, "max_num_seqs": max_num_seqs, "num_blocks": num_blocks,
              "mixed_step_graphs": "off" if device.type != "cuda" else args.mixed_step_graphs,
              "block_size": block_size, "host_bytes": host_bytes, "configs": {}}
    if device.type == "cuda":
        result["pinned_bandwidth"] = pinned_bandwidth(device)
    h2d = result["pinned_bandwidth"]["h2d_bytes_per_s"] if device.type == "cuda" else SMOKE_H2D_BYTES_PER_S
    turns = workload.fixed_turns()  # the same prompts, in the same order, in every configuration
    other = dataclasses.replace(workload, seed=workload.seed + 1)
    result["warm_up_s"] = warm_kernels(LLM(**common, kv_offload_memory=host_bytes), other, max_num_seqs)
    print(f"{name} | warm-up: the whole workload of another seed through the tiers, "
          f"{result['warm_up_s']:.1f} s", flush=True)
    freeze = args.gc == "freeze"
    for label, options in configs:
        llm = LLM(**common, **options)
        run_chat(llm.engine, dataclasses.replace(other, num_conversations=2, num_concurrent=2).fixed_turns(),
                 max_num_seqs)  # this engine's first steps
        stats_before = llm.stats()
        slug = f"{name}_{re.sub(r'[^a-z0-9]+', '_', label.lower())}"
        if args.profile_host:  # where the host time of the steps goes, per configuration (cProfile slows it)
            run = profiled(lambda: run_chat(llm.engine, turns, max_num_seqs, system_len, freeze_heap=freeze),
                           Path(args.out) / f"host_profile_{slug}.txt")
        elif args.profile_torch:  # which runtime calls block the step loop, per configuration
            run = torch_profiled(lambda: run_chat(llm.engine, turns, max_num_seqs, system_len, freeze_heap=freeze),
                                 Path(args.out) / f"torch_profile_{slug}.txt")
        else:
            run = run_chat(llm.engine, turns, max_num_seqs, system_len, freeze_heap=freeze)
        stats = {k: v - stats_before.get(k, 0) if isinstance(v, (int, float)) else v for k, v in llm.stats().items()}
        prompts = run.pop("prompts")
        row = {**run, **_tier_summary(stats, block_size, llm.engine.pool.bytes_per_block, prompts,
                                            "kv_offload_memory" in options),
               "prompts_hash": hash(tuple((rid, tuple(p)) for rid, p in prompts.items()))}
        result["configs"][label] = row
        reuse = (f" (turns reusing a system prompt: P50 {run['ttft_reuse_p50_s'] * 1e3:.1f} ms, P99 "
                 f"{run['ttft_reuse_p99_s'] * 1e3:.1f} ms)" if run["ttft_reuse_p50_s"] is not None else "")
        print(f"{name} | {label}: TTFT P50 {run['ttft_p50_s'] * 1e3:.1f} ms, P99 {run['ttft_p99_s'] * 1e3:.1f} ms{reuse}, "
              f"{run['output_tokens_per_s']:,.0f} output tok/s, hits GPU {row['gpu_hit_rate'] * 100:.0f}% host "
              f"{row['host_hit_rate'] * 100:.0f}%", flush=True)
        print(f"{name} | {label} steps: {step_line(run['steps'])}", flush=True)
        # What can stall a step beside its own work: a full garbage collection, and (tiers) a spill into a host
        # block whose disk write is still queued, which happens only when every host block it could take is (and
        # never while the host tier has free blocks).
        host = llm.stats()
        row["host_blocks_cached_at_end"] = host.get("kv_host_cached_blocks", 0)
        tiers = (f"; steps waited {row['kv_disk_write_wait_seconds'] * 1e3:.1f} ms for {row['kv_disk_write_waits']} "
                 f"host blocks' disk writes ({row['kv_disk_written_blocks']} written; host tier "
                 f"{host['kv_host_cached_blocks']} of {host['kv_host_blocks']} blocks cached)") if host.get(
                     "kv_host_blocks") else ""
        print(f"{name} | {label} stalls: longest GC pause {run['gc_max_pause_s'] * 1e3:.1f} ms "
              f"({run['gc_collections'][2]} full collections){tiers}", flush=True)
        if label == "GPU only":  # after its run, so the probes' prompts leave the measured run alone
            result["restore_bound"] = bound = restore_bound(llm.engine, workload, block_size, h2d)
            print(f"{name} | bound: a {bound['prefix_tokens']}-token prefix + {bound['user_tokens']}-token message "
                  f"prefill {bound['prefill_s'] * 1e3:.1f} ms; copying the prefix {bound['copy_s'] * 1e3:.1f} ms "
                  f"+ the message's prefill {bound['user_prefill_s'] * 1e3:.1f} ms: TTFT at most "
                  f"{bound['max_ttft_gain']:.2f}x lower", flush=True)
        if label == TIERED:  # the restart replays its prompts on its disk
            tiered_prompts = prompts
        # Shut down before the next configuration's engine is built: the tiers' shutdown writes their cache to
        # disk (what the restart reads) and joins the disk writer threads, whose backlog would otherwise run on
        # beside the next configuration's graph captures and measured steps.
        llm.shutdown()
        del llm
    distinct = {key for p in prompts.values() for key in hittable_keys(p, block_size)}
    result["distinct_prefix_blocks"] = len(distinct)
    result["gpu_pool_share_of_prefixes"] = num_blocks / len(distinct) if distinct else 0.0
    result["same_prompts"] = len({row["prompts_hash"] for row in result["configs"].values()}) == 1
    result["restart"] = r = restart(LLM, common, tiered, workload, tiered_prompts, block_size)
    shutil.rmtree(offload_dir, ignore_errors=True)
    print(f"{name} | restart: per distinct prompt block {r['disk_share'] * 100:.1f}% read from disk, "
          f"{r['not_computed_share'] * 100:.1f}% not computed; first TTFT {r['first_ttft_s'] * 1e3:.1f} ms",
          flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def restart(LLM, common: dict, options: dict, workload: MultiTurnChat, prompts: dict, block_size: int) -> dict:
    """A new engine on the same directory serves the last turns of the last conversations again, one at a time.

    Per distinct prompt block: read from disk (restored from a host block that a disk read filled: the host
    tier starts empty) and not computed (read from disk, or shared on the GPU after a prompt read it)."""
    from pagedkv.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(**common, **options)
    startup_s = time.perf_counter() - start
    last = f"-t{workload.num_turns - 1}"
    replay = [p for rid, p in prompts.items() if rid.endswith(last)][-8:]  # the latest: what the LRU cap keeps
    engine = llm.engine
    engine.stream_outputs = True
    ttfts = []
    read, computed, distinct = set(), set(), set()
    hit_fields = ("kv_gpu_hit_blocks", "kv_host_hit_blocks", "kv_disk_hit_blocks")
    for index, prompt in enumerate(replay):  # one at a time: each TTFT is a cold engine's
        keys = hittable_keys(prompt, block_size)
        distinct.update(keys)
        before = llm.stats()
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        begin = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - begin
        ttfts.append(first)
        after = llm.stats()
        gpu, host, disk = (after[f] - before[f] for f in hit_fields)
        read.update(keys[gpu:gpu + host + disk])  # a prompt's hits: GPU first, then the restored run
        computed.update(keys[gpu + host + disk:])
    stats = llm.stats()
    hittable = sum((len(p) - 1) // block_size for p in replay)
    llm.shutdown()
    return {"startup_s": startup_s, "num_requests": len(replay), "hittable_blocks": hittable,
            "distinct_blocks": len(distinct), "disk_hit_blocks": stats["kv_disk_hit_blocks"],
            "gpu_hit_blocks": stats["kv_gpu_hit_blocks"], "host_hit_blocks": stats["kv_host_hit_blocks"],
            # a block computed here and spilled is restored from the host later: that is no disk read
            "disk_share": len((read - computed) & distinct) / len(distinct) if distinct else 0.0,
            "not_computed_share": 1 - len(computed & distinct) / len(distinct) if distinct else 0.0,
            "request_disk_share": stats["kv_disk_hit_blocks"] / hittable if hittable else 0.0,
            "disk_load_misses": stats["kv_disk_load_misses"], "first_ttft_s": ttfts[0] if ttfts else None,
            "ttft_s": ttfts, "disk_read_seconds": stats["kv_disk_read_seconds"]}


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
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedkv-kv-tiers-") as scratch:
        for name in names:
            directory = Path(args.kv_offload_dir or scratch) / name
            result["models"][name] = run_model(name, args, device, directory)
            write_json(args.out, "kv_tiers", result)  # after every model: a run cut short keeps what it measured
            text = markdown(result)
            (Path(args.out) / "kv_tiers.md").write_text(text + "\n")
    print(text)
    return 0
