"""`pagedkv bench parallel`: tensor parallel against one GPU, data-parallel replicas, and routing policies.

Sections (each appends to `<out>/parallel.json`, so a run cut short keeps what it measured):

- `tp1`, `tp2`: Llama-3-8B shape, bf16, at tensor_parallel_size 1 and 2: decode ms per step at
  batch 1, 64 and 256 (128-token prompts, 64 new tokens) and nano-vllm's workload (256 requests),
  with the run's steps grouped (steps with prefill; decode-only steps by batch size).
- `tp2-symm`: `tp2` with PAGEDKV_TP_ALL_REDUCE=symm_mem (torch's one-shot symmetric-memory
  all-reduce instead of NCCL's).
- `tp2-bound`: one rank's shard of the TP=2 model (half the heads, MLP width and vocab rows)
  run as a whole model on one GPU: what a TP=2 step costs without its collectives, broadcasts
  and worker processes, so `tp2` against it is the price of the communication.
- `tp-greedy`: the same shape in fp32: greedy tokens at tensor_parallel_size 2 against 1 (the
  sums of two shards round differently from one matmul only in the last bits of fp32, so the
  tokens must agree).
- `dp1`, `dp2`: Qwen3-0.6B shape, nano-vllm's workload with 512 requests, on one engine and on
  two replicas behind the router.
- `routing`: two replicas, a shared-prefix chat workload (32 system prompts of 1,000 tokens),
  prefix-aware routing against round-robin and least-loaded: prefix-cache hit rate and
  throughput, each policy on fresh, warmed-up replicas. `--system-prompts 256 --routing-kv-gib 12`
  is the case where routing matters: the prefixes no longer fit every replica's pool.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from pagedkv.bench.common import require_cuda
from pagedkv.bench.engine import nano_vllm_workload
from pagedkv.cli import ArgumentParser
from pagedkv.engine.outputs import STEP_PHASES
from pagedkv.results import add_out_argument, provenance

DTYPE = "bfloat16"
MAX_MODEL_LEN = 4096
SYSTEM_PROMPT_TOKENS = 1000


def _record(out: Path, key: str, value: dict) -> None:
    path = out / "parallel.json"
    data = json.loads(path.read_text()) if path.exists() else {"benchmark": "parallel",
                                                               "provenance": provenance(torch.cuda.get_device_name())}
    data[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(key, json.dumps(value)[:400], flush=True)


def _free_gpu() -> None:
    """Let the next section start from an empty GPU (an engine's pool is most of it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decode_ms(llm, batch: int, vocab: int, phases: dict | None = None) -> float:
    """Median decode step (ms) at `batch`; `phases` receives the median of each StepTiming phase (ms)."""
    from pagedkv.engine.sampling_params import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(3, min(vocab, 10000)) for _ in range(128)] for _ in range(batch)]
    engine = llm.engine
    engine.step_timings = []
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    steps = [t for t in engine.step_timings if t.shape.prefill_tokens == 0 and t.shape.decode_seqs == batch]
    engine.step_timings = None
    if phases is not None:
        for name in STEP_PHASES:
            phases[name[:-2] + "_ms"] = statistics.median(getattr(t, name) for t in steps) * 1e3
    return statistics.median(t.total_s for t in steps) * 1e3


def _throughput(llm, prompts, output_lens, breakdown: bool = False) -> dict:
    """Output tok/s of one `generate` over the prompts; `breakdown` adds where the run's steps spent it."""
    from pagedkv.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    engine = llm.engine
    if breakdown:
        engine.step_timings = []
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"elapsed_s": elapsed, "num_output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}
    if breakdown:
        result["steps"] = _step_breakdown(engine.step_timings)
        engine.step_timings = None
    return result


def _step_breakdown(timings) -> dict:
    """Seconds and counts of the run's steps: those with prefill tokens (eager) and decode-only ones by batch."""
    groups: dict[str, list] = {}
    for t in timings:
        if t.shape.prefill_tokens:
            key = "with_prefill"
        else:
            low = 1 << max(0, (t.shape.decode_seqs - 1).bit_length() - 1) if t.shape.decode_seqs > 1 else 1
            key = f"decode_{low}-{2 * low - 1}" if low > 1 else "decode_1"
        groups.setdefault(key, []).append(t)
    out = {}
    for key, steps in sorted(groups.items()):
        out[key] = {"num_steps": len(steps), "total_s": sum(t.total_s for t in steps),
                    "median_step_ms": statistics.median(t.total_s for t in steps) * 1e3,
                    "median_wait_ms": statistics.median(t.wait_s for t in steps) * 1e3}
    return out


def shard_model(model: str, tp: int) -> str:
    """`random:NAME` -> a registered `random:NAME-tpN-shard`: one TP rank's shard of NAME as a whole model.

    Heads, KV heads and MLP width divided by `tp`, the vocab rows too (each rank's LM head and
    embedding shard; the sampler then scans 1/tp of the vocab, a few microseconds less).
    """
    from pagedkv.models.loader import RANDOM_CONFIGS

    base = model.split(":", 1)[1]
    cfg = dict(RANDOM_CONFIGS[base])
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        cfg[key] //= tp
    cfg["vocab_size"] = -(-cfg["vocab_size"] // tp)
    name = f"{base}-tp{tp}-shard"
    RANDOM_CONFIGS[name] = cfg
    return f"random:{name}"


def tensor_parallel(tp: int, out: Path, model: str = "random:llama3-8b", key: str | None = None) -> None:
    from pagedkv.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(model, dtype=DTYPE, tensor_parallel_size=tp, kv_cache_memory=0.6,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=256, max_num_batched_tokens=8192)
    startup = time.perf_counter() - start
    vocab = llm.engine.vocab_size
    warm, warm_lens = nano_vllm_workload(8, 32, 64, seed=1, vocab=vocab)
    _throughput(llm, warm, warm_lens)
    phases: dict[str, dict] = {"1": {}, "64": {}, "256": {}}
    result = {"model": model, "tensor_parallel_size": tp, "startup_s": startup,
              "all_reduce": llm.engine.tp.all_reduce_mode if llm.engine.tp is not None else None,
              "decode_ms": {b: _decode_ms(llm, int(b), vocab, phases[b]) for b in phases},
              "decode_phases_ms": phases}
    prompts, output_lens = nano_vllm_workload(256, 100, 1024, 0, vocab)
    result["nano"] = _throughput(llm, prompts, output_lens, breakdown=True)
    llm.engine.shutdown()
    del llm
    _free_gpu()
    _record(out, key or f"tp{tp}", result)


def tensor_parallel_greedy(out: Path, model: str = "random:llama3-8b", num_prompts: int = 8,
                           max_tokens: int = 32) -> None:
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    rng = random.Random(7)
    vocab = 400 if "tiny" in model else 10000
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 100))] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(model, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=4 * 2**30, max_model_len=MAX_MODEL_LEN // 2,
                  max_num_seqs=num_prompts)
        tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.shutdown()
        del llm
        _free_gpu()
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(tokens[1], tokens[2])]
    _record(out, "tp_greedy_fp32", {"model": model, "num_prompts": num_prompts, "max_tokens": max_tokens,
                                    "identical": tokens[1] == tokens[2], "first_divergence": first_diff})


def data_parallel(dp: int, out: Path, model: str = "random:qwen3-0.6b") -> None:
    from pagedkv.engine.llm import LLM

    start = time.perf_counter()
    options = dict(dtype=DTYPE, kv_cache_memory=0.5, max_model_len=MAX_MODEL_LEN, max_num_seqs=256,
                   max_num_batched_tokens=8192)
    llm = LLM(model, data_parallel_size=dp, **options)
    startup = time.perf_counter() - start
    vocab = 500 if "tiny" in model else 151936
    warm, warm_lens = nano_vllm_workload(16, 32, 64, seed=1, vocab=vocab)
    _throughput(llm, warm, warm_lens)
    prompts, output_lens = nano_vllm_workload(512, 100, 1024, 0, vocab)
    result = {"data_parallel_size": dp, "startup_s": startup, "nano_512": _throughput(llm, prompts, output_lens)}
    if dp > 1:
        result["requests_per_replica"] = list(llm.engine.router.stats.num_per_replica)
        llm.engine.shutdown()
    _record(out, f"dp{dp}", result)


def _chat_prompts(rng: random.Random, systems: list[list[int]], num_requests: int) -> list[list[int]]:
    """`num_requests` prompts: a random system prompt of `systems`, then 20-100 tokens of user turn."""
    return [systems[rng.randrange(len(systems))] + [rng.randrange(3, 400) for _ in range(rng.randint(20, 100))]
            for _ in range(num_requests)]


def routing(out: Path, num_requests: int, num_system_prompts: int, model: str = "random:qwen3-0.6b",
            kv_cache_gib: float | None = None, policies: tuple[str, ...] = ("prefix", "round_robin", "least_loaded"),
            key: str = "routing") -> None:
    """Two replicas, a shared-prefix chat workload, one run per routing policy.

    Each policy gets a fresh pair of replicas, warmed up first on prompts with other system
    prompts (so Triton compiles, CUDA graphs and allocator growth stay out of the timed run,
    which would otherwise charge them to whichever policy runs first, and the prefix caches
    start cold for the timed prompts). `kv_cache_gib` caps each replica's KV pool: with many
    system prompts and a small pool, a replica that sees every system prompt (round-robin)
    evicts what one that sees half of them (prefix-aware) keeps.
    """
    from pagedkv.engine.config import EngineConfig
    from pagedkv.distributed.data_parallel import DataParallelEngine
    from pagedkv.engine.llm import LLM
    from pagedkv.distributed.router import RouterConfig
    from pagedkv.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = 10000 if DTYPE != "float32" else 400
    systems = [[rng.randrange(3, vocab) for _ in range(SYSTEM_PROMPT_TOKENS)] for _ in range(num_system_prompts)]
    prompts = _chat_prompts(rng, systems, num_requests)
    warm_systems = [[rng.randrange(3, vocab) for _ in range(SYSTEM_PROMPT_TOKENS)] for _ in range(4)]
    warm = _chat_prompts(rng, warm_systems, 64)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    memory = int(kv_cache_gib * 2**30) if kv_cache_gib else 0.5  # an int is bytes, a float a fraction
    results = {}
    for policy in policies:
        config = EngineConfig(model=model, dtype=DTYPE, kv_cache_memory=memory, max_model_len=MAX_MODEL_LEN,
                              max_num_seqs=256, max_num_batched_tokens=8192)
        engine = DataParallelEngine(config, 2, router_config=RouterConfig(policy=policy))
        try:
            llm = LLM.__new__(LLM)
            llm.engine, llm._counter = engine, 0
            llm.generate(warm, params)
            before = engine.stats().as_dict()
            routed_before = list(engine.router.stats.num_per_replica)
            # Submitted the way LLM.generate submits (all, then step), timed in parts, with the time
            # each replica's last request finished: a slow policy shows where its time went.
            start = time.perf_counter()
            replica_of = {}
            for index, prompt in enumerate(prompts):
                engine.add_request(f"route-{index}", prompt, params)
                replica_of[f"route-{index}"] = engine._request_replica[f"route-{index}"]
            submitted = time.perf_counter() - start
            last_done = [0.0, 0.0]
            remaining = len(prompts)
            while remaining:
                for output in engine.step():
                    if output.finished:
                        remaining -= 1
                        last_done[replica_of[output.request_id]] = time.perf_counter() - start
            elapsed = time.perf_counter() - start
            stats = engine.stats().as_dict()
            queries = stats["prefix_cache_queries"] - before["prefix_cache_queries"]
            per_replica = [{name: now[name] - then[name] for name in ("busy_seconds", "num_steps",
                                                                       "num_prompt_tokens", "prefix_cache_hit_tokens")}
                           if now and then else None  # a replica that died or did not answer
                           for now, then in zip(stats["replicas"], before["replicas"])]
            results[policy] = {
                "elapsed_s": elapsed, "output_tokens_per_s": num_requests * 32 / elapsed,
                "submit_s": submitted, "replica_last_finish_s": last_done,
                "prefix_hit_rate": (stats["prefix_cache_hits"] - before["prefix_cache_hits"]) / max(1, queries),
                "prefix_hit_tokens": stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
                "prompt_tokens": sum(map(len, prompts)),
                "requests_per_replica": [a - b for a, b in zip(engine.router.stats.num_per_replica, routed_before)],
                "replicas": per_replica, "kv_blocks": stats["num_blocks"],
            }
            print(f"{key} {policy}: {results[policy]}", flush=True)
        finally:
            engine.shutdown()
            _free_gpu()
    _record(out, key, {"num_requests": num_requests, "num_system_prompts": num_system_prompts,
                       "system_prompt_tokens": SYSTEM_PROMPT_TOKENS, "kv_cache_gib_per_replica": kv_cache_gib,
                       **results})


def main(argv: list[str] | None = None, prog: str = "pagedkv bench parallel") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="+",
                        choices=("tp1", "tp2", "tp2-symm", "tp2-bound", "tp-greedy", "dp1", "dp2", "routing"))
    add_out_argument(parser, "parallel.json")
    parser.add_argument("--routing-requests", type=int, default=2048)
    parser.add_argument("--system-prompts", type=int, default=32)
    parser.add_argument("--routing-kv-gib", type=float, default=None,
                        help="routing: each replica's KV pool in GiB (default: half the free memory)")
    parser.add_argument("--routing-key", default="routing", help="routing: the result's key in parallel.json")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU (checks the script, not the speed)")
    args = parser.parse_args(argv)
    if not args.smoke:
        require_cuda("pagedkv bench parallel", "--smoke exercises the script on CPU")
    global DTYPE, MAX_MODEL_LEN, SYSTEM_PROMPT_TOKENS, nano_vllm_workload
    if args.smoke:
        DTYPE, MAX_MODEL_LEN, SYSTEM_PROMPT_TOKENS = "float32", 512, 100
        full = nano_vllm_workload
        nano_vllm_workload = lambda n, lo, hi, seed, vocab: full(min(n, 12), min(lo, 8), min(hi, 40), seed, vocab)
        torch.cuda.get_device_name = lambda *a: "cpu (smoke)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for section in args.sections:
        if section == "tp-greedy":
            tensor_parallel_greedy(out, *(["random:tiny-llama"] if args.smoke else []))
        elif section == "tp2-symm":  # TP=2 with the symmetric-memory all-reduce (the workers inherit the variable)
            before = os.environ.get("PAGEDKV_TP_ALL_REDUCE")
            os.environ["PAGEDKV_TP_ALL_REDUCE"] = "symm_mem"
            try:
                tensor_parallel(2, out, *(["random:tiny-llama"] if args.smoke else []), key="tp2_symm_mem")
            finally:
                if before is None:
                    os.environ.pop("PAGEDKV_TP_ALL_REDUCE")
                else:
                    os.environ["PAGEDKV_TP_ALL_REDUCE"] = before
        elif section == "tp2-bound":
            tensor_parallel(1, out, shard_model("random:tiny-llama" if args.smoke else "random:llama3-8b", 2),
                            key="tp2_shard_bound")
        elif section.startswith("tp"):
            tensor_parallel(int(section[2:]), out, *(["random:tiny-llama"] if args.smoke else []))
        elif section.startswith("dp"):
            data_parallel(int(section[2:]), out, *(["random:tiny-qwen3"] if args.smoke else []))
        else:
            routing(out, args.routing_requests, args.system_prompts,
                    "random:tiny-qwen3" if args.smoke else "random:qwen3-0.6b", args.routing_kv_gib,
                    key=args.routing_key)
    print(f"wrote parallel.json in {out}")
    return 0
