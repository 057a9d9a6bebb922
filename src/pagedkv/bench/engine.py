"""`pagedkv bench engine`: engine throughput on nano-vllm's offline workload, beside HF continuous batching.

The workload is nano-vllm's `bench.py`: 256 requests, prompt and output lengths each
uniform in [100, 1024] from a fixed seed, random token ids, `ignore_eos`. In one run and on the
same requests it times, side by side:

- pagedkv with its own decoder, CUDA-graph decode and full graphs for steps with prefill tokens
  (the default);
- the same with piecewise graphs for those steps (`mixed_step_graphs="piecewise"`), and with
  decode graphs only (`mixed_step_graphs="off"`);
- pagedkv with its own decoder, eager (`enforce_eager=True`);
- pagedkv on HF's modules through the `pagedkv` attention function (`model_impl="hf"`);
- transformers' own continuous batching (`generate_batch`'s manager, per-request max_new_tokens),
  under a time limit: when it runs out, the tokens finished so far over the time taken are reported,
  marked partial.

It also:
- checks greedy output against HF `generate` (DynamicCache, sdpa) for the first 32 tokens
  of 16 requests, reporting where any request diverges and by what logit margin;
- records every engine step's shape and time on a separate calibration workload and fits
  the simulator's step-time cost model (`cost_model.json`);
- writes the main run as a fidelity file (`engine_run.json`) for `pagedkv sim --fidelity`.

`--kv-cache-dtype fp8_e4m3` runs every pagedkv variant on an FP8 KV pool. `--preset kv-bound`
runs a different workload instead (`pagedkv.bench.engine_kv_bound`): Llama-3-8B shape, prompts of
1,000-2,000 tokens and outputs of 1,000-3,000 (decode-dominated), a pool that limits concurrency,
once per KV dtype (bf16 against FP8).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

from pagedkv.bench.common import require_cuda
from pagedkv.bench.engine_timing import decode_share, timed_generate
from pagedkv.cli import ArgumentParser, parse_size
from pagedkv.engine.config import MIXED_STEP_GRAPHS
from pagedkv.errors import InvalidArgumentError
from pagedkv.results import add_out_argument, provenance, write_json


def nano_vllm_workload(num_requests: int, min_len: int, max_len: int, seed: int, vocab: int):
    """(prompts as token ids, output lengths), as nano-vllm's bench.py draws them."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, min(vocab, 10000) - 1) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, output_lens


def _greedy_check(model, llm, prompts, num_tokens: int) -> dict:
    """Engine vs HF generate (sdpa, DynamicCache), one request at a time; margins where they differ."""
    from transformers import DynamicCache

    from pagedkv.engine.sampling_params import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    model.set_attn_implementation("sdpa")
    rows = []
    try:
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt], device=model.device)
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                 do_sample=False, past_key_values=DynamicCache(), eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            expected = ref.sequences[0, len(prompt):].tolist()
            got = out.outputs[0].token_ids
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
            row = {"prompt_len": len(prompt), "match": first is None, "first_divergence": first}
            if first is not None:
                scores = ref.scores[first][0].float()
                row["hf_margin_at_divergence"] = float(scores[expected[first]] - scores[got[first]])
            rows.append(row)
    finally:
        model.set_attn_implementation("pagedkv")
    return {"num_requests": len(rows), "num_tokens": num_tokens, "num_matching": sum(r["match"] for r in rows),
            "rows": rows}


def _hf_continuous_batching(model, prompts, output_lens, time_limit_s: float) -> dict:
    """transformers' continuous batching on the same requests (per-request max_new_tokens)."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        torch.cuda.synchronize()
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"hf{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(prompts, output_lens))]
        done, generated = set(), 0
        while len(done) < len(ids) and time.perf_counter() - start < time_limit_s:  # partial when it runs out
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done.add(result.request_id)
                generated += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
        manager.stop(block=True, timeout=30)
        return {"elapsed_s": elapsed, "num_finished": len(done), "num_requests": len(ids),
                "num_output_tokens": generated, "output_tokens_per_s": generated / elapsed,
                "complete": len(done) == len(ids)}
    except Exception as error:  # report, never crash the benchmark
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        model.set_attn_implementation("pagedkv")


SYSTEMS = ("pagedkv", "pagedkv_eager", "pagedkv_hf_modules", "hf_continuous_batching")


def chat_size(text: str) -> tuple[int, int, int, int, int]:
    """`--chat-size C,K,T,S,F`: five positive integers (conversations, system prompts, turns, system prompt
    tokens, turns in flight)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected five positive integers C,K,T,S,F, got {text!r}")
    return values


def build_parser(prog: str = "pagedkv bench engine") -> ArgumentParser:
    """`pagedkv bench engine`'s arguments."""
    from pagedkv.bench.engine_chat_tiers import EXTRA_CONFIGS

    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="random-weight architecture (pagedkv.hf.RANDOM_CONFIGS)")
    parser.add_argument("--preset", default="nano-vllm", choices=("nano-vllm", "kv-bound", "chat-tiers"),
                        help="nano-vllm: the offline workload above; kv-bound: FP8 vs bf16 KV where the pool limits "
                             "concurrency (see pagedkv.bench.engine_kv_bound); chat-tiers: KV tiers on multi-turn "
                             "chat, and a restart (see pagedkv.bench.engine_chat_tiers; --model may list several)")
    parser.add_argument("--kv-offload-memory", type=parse_size, default=0, metavar="SIZE",
                        help="host memory for the KV tiers (chat-tiers: its tiered configuration, default 16GiB)")
    parser.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                        help="the KV tiers' disk directory (chat-tiers default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="chat-tiers: toy size on the CPU (checks the code)")
    parser.add_argument("--profile-host", action="store_true",
                        help="chat-tiers: cProfile each configuration's run (slower) and write the host functions "
                             "by time to host_profile_<model>_<config>.txt in --out")
    parser.add_argument("--profile-torch", action="store_true",
                        help="chat-tiers: torch.profiler over each configuration's run (slower): its ops and CUDA "
                             "runtime calls (a synchronize, a pageable copy, a pinned allocation) by their own host "
                             "time, and by device time, in torch_profile_<model>_<config>.txt in --out")
    parser.add_argument("--gc", default="freeze", choices=("freeze", "on"),
                        help="chat-tiers: freeze: the heap is frozen before each measured run (gc.freeze after a "
                             "collection, as `pagedkv serve` does after startup), so a full collection walks only "
                             "what the run allocates; on: the collector as it is (full passes stall a step)")
    parser.add_argument("--chat-size", type=chat_size, default=None, metavar="C,K,T,S,F",
                        help="chat-tiers: C conversations of T turns over K system prompts of S tokens, F turns in "
                             "flight, for every model (default per model: 128,64,3,1024,4 for Qwen3-0.6B, "
                             "96,48,3,1024,4 for Llama-3-8B); e.g. 32,16,3,8192,2 for long shared prefixes")
    for extra in EXTRA_CONFIGS:
        parser.add_argument(extra.flag, action="store_true", help=f"chat-tiers: one more configuration, {extra.help}")
    parser.add_argument("--in-step-restore-tokens", type=int, default=None, metavar="T",
                        help="chat-tiers: one more configuration, the tiers with at most T tokens' worth of restored "
                             "blocks copied before a step's kernels (--kv-offload-in-step-restore-tokens; 0: every "
                             "restore beside the step), beside the default's")
    parser.add_argument("--mixed-step-graphs", default="full", choices=MIXED_STEP_GRAPHS,
                        help="chat-tiers: CUDA graphs for steps with prefill tokens, in every configuration "
                             "(default %(default)s, the engine's; off: such steps run eagerly, each engine starts "
                             "faster)")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="KV pool dtype: auto, fp8_e4m3 or fp8_e5m2 (nano-vllm preset, default auto); "
                             "comma-separated dtypes to compare (kv-bound preset, default auto,fp8_e4m3)")
    parser.add_argument("--kv-budget-gib", type=float, default=None,
                        help="kv-bound: KV pool GiB (default 7: about 16 full bf16 sequences of the workload)")
    parser.add_argument("--requests", type=int, default=None, help="requests (default 256; kv-bound: 128)")
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", type=float, default=0.3, help="fraction of free GPU memory")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--hf-time-limit", type=float, default=240.0)
    parser.add_argument("--skip-hf", action="store_true", help="skip transformers' continuous batching")
    parser.add_argument("--skip", default="", help="comma-separated variants to skip: pagedkv_piecewise,pagedkv_decode_graphs_only,"
                             "pagedkv_eager,pagedkv_hf_modules")
    parser.add_argument("--calibration-requests", type=int, default=96)
    add_out_argument(parser, "engine.json, engine.md, engine_run.json and cost_model.json")
    return parser


def main(argv: list[str] | None = None, prog: str = "pagedkv bench engine") -> int:
    """Run the benchmark; print a table; write engine.json, engine.md, engine_run.json and cost_model.json."""
    from rich.console import Console
    from rich.table import Table

    from pagedkv.engine.llm import LLM
    from pagedkv.models.loader import random_model

    args = build_parser(prog).parse_args(argv)
    from pagedkv.core.memory import check_kv_cache_dtype

    if args.preset == "chat-tiers":
        from pagedkv.bench import engine_chat_tiers

        return engine_chat_tiers.run(args)
    if args.smoke:
        raise InvalidArgumentError("--smoke applies only to --preset chat-tiers")
    if args.preset == "kv-bound":
        from pagedkv.bench import engine_kv_bound

        args.kv_cache_dtype = args.kv_cache_dtype or "auto,fp8_e4m3"
        for name in args.kv_cache_dtype.split(","):
            check_kv_cache_dtype(name)
        return engine_kv_bound.run(args)
    args.kv_cache_dtype = check_kv_cache_dtype(args.kv_cache_dtype or "auto")
    args.requests = args.requests or 256
    require_cuda("pagedkv bench engine")

    console = Console()
    device = torch.device("cuda")
    model = random_model(args.model, torch.bfloat16, device)
    vocab = model.config.vocab_size

    def make_llm(**options):
        return LLM(hf_model=model, kv_cache_memory=args.kv_cache_memory, max_model_len=4096,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   kv_cache_dtype=args.kv_cache_dtype, kv_offload_memory=args.kv_offload_memory,
                   kv_offload_dir=args.kv_offload_dir, **options)

    start = time.perf_counter()
    llm = make_llm()
    startup_s = time.perf_counter() - start
    engine = llm.engine
    result = {"benchmark": "engine", "model": f"random:{args.model} (bf16)", "provenance": provenance(
        torch.cuda.get_device_name()), "engine": {"num_blocks": engine.scheduler.block_manager.num_blocks,
                                                  "block_size": engine.pool.block_size,
                                                  "max_num_seqs": args.max_num_seqs,
                                                  "max_num_batched_tokens": args.max_num_batched_tokens,
                                                  "max_model_len": engine.max_model_len,
                                                  "kv_cache_dtype": args.kv_cache_dtype,
                                                  "startup_s": startup_s,
                                                  "num_graphs": len(engine.runner.graphs)}}

    check_prompts, _ = nano_vllm_workload(16, 16, 256, seed=args.seed + 99, vocab=vocab)
    result["greedy_check"] = _greedy_check(model, llm, check_prompts, 32)
    console.print(f"greedy vs HF generate: {result['greedy_check']['num_matching']}/16 requests identical "
                  f"for 32 tokens")

    warm_prompts, warm_lens = nano_vllm_workload(8, 32, 64, seed=1, vocab=vocab)
    timed_generate(llm, warm_prompts, warm_lens)

    steps: list[dict] = []
    cal_prompts, cal_lens = nano_vllm_workload(args.calibration_requests, 16, 1024, seed=args.seed + 7, vocab=vocab)
    result["calibration_run"] = timed_generate(llm, cal_prompts, cal_lens, record=steps)

    prompts, output_lens = nano_vllm_workload(args.requests, args.min_len, args.max_len, args.seed, vocab)
    main_steps: list[dict] = []
    result["pagedkv"] = timed_generate(llm, prompts, output_lens, record=main_steps)
    # The share of step time in steps with prefill tokens: what prefill (and its kernels) can move.
    result["pagedkv"]["prefill_share"] = 1.0 - decode_share(main_steps) if main_steps else None
    console.print(f"pagedkv (own decoder, CUDA graphs): {result['pagedkv']['output_tokens_per_s']:,.0f} output tok/s "
                  f"({result['pagedkv']['elapsed_s']:.1f} s; steps with prefill tokens: "
                  f"{100 * (result['pagedkv']['prefill_share'] or 0):.0f}% of step time)")
    del llm, engine
    torch.cuda.empty_cache()
    variants = (("pagedkv_piecewise", {"mixed_step_graphs": "piecewise"}),
                ("pagedkv_decode_graphs_only", {"mixed_step_graphs": "off"}), ("pagedkv_eager", {"enforce_eager": True}),
                ("pagedkv_hf_modules", {"model_impl": "hf"}))
    for name, options in variants:
        if name in args.skip:
            continue
        variant = make_llm(**options)
        timed_generate(variant, warm_prompts, warm_lens)
        result[name] = timed_generate(variant, prompts, output_lens)
        console.print(f"{name}: {result[name]['output_tokens_per_s']:,.0f} output tok/s "
                      f"({result[name]['elapsed_s']:.1f} s)")
        del variant
        torch.cuda.empty_cache()
    if not args.skip_hf:
        result["hf_continuous_batching"] = _hf_continuous_batching(model, prompts, output_lens, args.hf_time_limit)
        console.print(f"HF continuous batching: {result['hf_continuous_batching']}")
        hf = result["hf_continuous_batching"]
        if "output_tokens_per_s" in hf:
            result["pagedkv_vs_hf_continuous_batching"] = (result["pagedkv"]["output_tokens_per_s"]
                                                           / hf["output_tokens_per_s"])

    from pagedkv.sim.cost_model import StepMeasurement, fit

    fitted = fit([StepMeasurement(**s) for s in steps])
    cost = {"model": result["model"], "gpu": torch.cuda.get_device_name(), "measurements": steps,
            "constants": dataclasses.asdict(fitted),
            "provenance": result["provenance"], "note": "fitted on the calibration run (seed +7), not the main run"}
    write_json(args.out, "cost_model", cost)
    run_file = {"model": result["model"], "gpu": torch.cuda.get_device_name(),
                "workload": {"prompt_lens": [len(p) for p in prompts], "output_lens": output_lens, "clients": None},
                "engine": {**result["engine"], "watermark": 0.01, "preemption_mode": "recompute",
                           "victim_policy": "newest", "num_swap_blocks": 0, "enable_prefix_caching": True,
                           "enable_chunked_prefill": True},
                "measured": {"output_tokens_per_s": result["pagedkv"]["output_tokens_per_s"],
                             "elapsed_s": result["pagedkv"]["elapsed_s"],
                             "num_output_tokens": result["pagedkv"]["num_output_tokens"]},
                "provenance": result["provenance"]}
    write_json(args.out, "engine_run", run_file)
    result["main_run_steps"] = main_steps[:4000]

    table = Table(title=f"Engine throughput, nano-vllm workload ({args.requests} requests), "
                        f"{result['provenance']['device']}")
    table.add_column("system")
    table.add_column("output tok/s", justify="right")
    table.add_column("elapsed s", justify="right")
    table.add_column("output tokens", justify="right")
    for name in SYSTEMS:
        row = result.get(name)
        if not row:
            continue
        if "error" in row:
            table.add_row(name, "n/a", "-", row["error"][:60])
            continue
        table.add_row(name, f"{row['output_tokens_per_s']:,.0f}", f"{row['elapsed_s']:.1f}",
                      f"{row['num_output_tokens']:,}" + ("" if row.get("complete", True) else " (time limit)"))
    console.print(table)
    write_json(args.out, "engine", result)
    lines = [f"# Engine benchmark ({result['provenance']['device']}, {result['provenance']['date']}, "
             f"commit {result['provenance']['commit']})", "", "| system | output tok/s | elapsed s | tokens |",
             "|---|---:|---:|---:|"]
    for name in SYSTEMS:
        row = result.get(name)
        if row and "error" not in row:
            lines.append(f"| {name} | {row['output_tokens_per_s']:,.0f} | {row['elapsed_s']:.1f} | "
                         f"{row['num_output_tokens']:,} |")
        elif row:
            lines.append(f"| {name} | n/a ({row['error'][:80]}) | | |")
    check = result["greedy_check"]
    lines += ["", f"Greedy check vs HF generate: {check['num_matching']}/{check['num_requests']} requests identical "
              f"for {check['num_tokens']} tokens."]
    if result["pagedkv"].get("prefill_share") is not None:
        lines += ["", f"Steps with prefill tokens took {100 * result['pagedkv']['prefill_share']:.1f}% of pagedkv's "
                      f"step time."]
    from pathlib import Path

    Path(args.out, "engine.md").write_text("\n".join(lines) + "\n")
    print(f"wrote engine.json, engine.md, engine_run.json and cost_model.json in {args.out}")
    return 0
