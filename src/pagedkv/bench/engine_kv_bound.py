"""`pagedkv bench engine --preset kv-bound`: a decode-dominated workload whose concurrency the KV pool limits.

Llama-3-8B shape (random weights, bf16; 32 layers, 8 KV heads of 128: 128 KiB of bf16 KV per
token), requests with prompts uniform in [1,000, 2,000] tokens and outputs uniform in [1,000,
3,000], all submitted at once (`--requests`, default 128), and a KV pool of a fixed number of
bytes (`--kv-budget-gib`, default 7 GiB: about 16 of these sequences at their full length in
bf16). 128 requests keep even the FP8 pool (~32 sequences) full for four turnovers: with 64 the
FP8 run was two pools' worth, and its tail of a few sequences, not KV-bound, weighed twice as much. Most of the run is
decode steps over long contexts, the regime where KV bytes set both how many sequences fit and
how long each step reads. The same requests run once per `--kv-cache-dtype` (default bf16 then
fp8_e4m3), each with a fresh engine on the same budget, so an FP8 pool holds twice the blocks.
Reported per dtype:

    blocks              the pool's blocks (of 16 tokens) in the budget
    concurrent seqs     sequences scheduled per step: mean over decode steps, and the peak
    output tok/s        generated tokens / wall time of the run (prefill included)
    decode share        time of steps without prefill tokens / time of all steps
    preemptions         what the pool's limit cost

plus FP8 over bf16 for throughput (target: >= 1.4x). A benchmark: it never asserts.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from pagedkv.bench.engine_timing import decode_share, timed_generate

#: FP8 output tok/s over the model dtype's, at least.
TARGET_SPEEDUP = 1.4
#: Prompt and output token ranges (uniform, inclusive) and the KV budget that holds ~16 full bf16 sequences.
PROMPT_TOKENS, OUTPUT_TOKENS, DEFAULT_BUDGET_GIB = (1000, 2000), (1000, 3000), 7.0
DEFAULT_REQUESTS = 128


def kv_bound_workload(num_requests: int, seed: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths): prompts of PROMPT_TOKENS, outputs of OUTPUT_TOKENS (contexts of 2,000-5,000)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        prompt_len = rng.randint(*PROMPT_TOKENS)
        outputs.append(rng.randint(*OUTPUT_TOKENS))
        prompts.append([rng.randint(0, min(vocab, 10000) - 1) for _ in range(prompt_len)])
    return prompts, outputs


def run_one(model, kv_cache_dtype: str, budget_bytes: int, prompts, output_lens, max_num_batched_tokens: int) -> dict:
    """One engine on `budget_bytes` of KV in `kv_cache_dtype`: concurrency, throughput, preemptions."""
    from pagedkv.engine.llm import LLM

    llm = LLM(hf_model=model, kv_cache_memory=budget_bytes, kv_cache_dtype=kv_cache_dtype, max_model_len=8192,
              max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens)
    engine = llm.engine
    timed_generate(llm, [p[:64] for p in prompts[:4]], [8] * 4)  # warm-up: kernels compiled, graphs replayed once
    steps: list[dict] = []
    run = timed_generate(llm, prompts, output_lens, record=steps)  # num_preemptions: the warm-up had none
    decoding = [step["decode_seqs"] for step in steps if step["decode_seqs"]]
    result = {"kv_cache_dtype": kv_cache_dtype, "kv_dtype": str(engine.pool.dtype).removeprefix("torch."),
              "num_blocks": engine.scheduler.block_manager.num_blocks, "block_size": engine.pool.block_size,
              "bytes_per_block": engine.pool.bytes_per_block, "scales": engine.pool.scales_source, **run,
              "mean_concurrent_seqs": sum(decoding) / len(decoding) if decoding else 0.0,
              "peak_concurrent_seqs": max(decoding, default=0), "num_steps": len(steps),
              "decode_share": decode_share(steps),
              "num_decode_only_steps": sum(1 for step in steps if not step["prefill_tokens"])}
    del llm, engine
    torch.cuda.empty_cache()
    return result


def run(args) -> int:
    """The kv-bound preset of `pagedkv bench engine` (arguments parsed there); writes engine_kv_bound.json / .md."""
    from pagedkv.bench.common import require_cuda
    from pagedkv.models.loader import random_model
    from pagedkv.results import provenance, write_json

    require_cuda("pagedkv bench engine")
    dtypes = [name for name in args.kv_cache_dtype.split(",") if name]
    if len(dtypes) == 1 and dtypes[0] != "auto":
        dtypes = ["auto", *dtypes]  # always against the model dtype, in the same run
    model = random_model("llama3-8b", torch.bfloat16, torch.device("cuda"))
    prompts, output_lens = kv_bound_workload(args.requests or DEFAULT_REQUESTS, args.seed, model.config.vocab_size)
    budget = int((args.kv_budget_gib or DEFAULT_BUDGET_GIB) * 2**30)
    result = {"benchmark": "engine_kv_bound", "model": "random:llama3-8b (bf16)",
              "provenance": provenance(torch.cuda.get_device_name()), "kv_budget_bytes": budget,
              "workload": {"num_requests": len(prompts), "prompt_lens": [len(p) for p in prompts],
                           "output_lens": output_lens, "seed": args.seed}, "runs": []}
    for kv_cache_dtype in dtypes:
        row = run_one(model, kv_cache_dtype, budget, prompts, output_lens, args.max_num_batched_tokens)
        result["runs"].append(row)
        print(f"{kv_cache_dtype:<9} {row['num_blocks']:>6} blocks  concurrent seqs mean "
              f"{row['mean_concurrent_seqs']:.1f} "
              f"peak {row['peak_concurrent_seqs']}  {row['output_tokens_per_s']:,.0f} output tok/s  "
              f"decode share {100 * row['decode_share']:.0f}%  {row['num_preemptions']} preemptions  "
              f"({row['elapsed_s']:.1f} s)", flush=True)
    base = result["runs"][0]
    lines = [f"# KV-bound engine workload, {result['provenance']['device']} ({result['provenance']['date']}, commit "
             f"{result['provenance']['commit']})", "",
             f"random:llama3-8b (bf16), {len(prompts)} requests (prompts of {PROMPT_TOKENS[0]:,}-"
             f"{PROMPT_TOKENS[1]:,} tokens, outputs of {OUTPUT_TOKENS[0]:,}-{OUTPUT_TOKENS[1]:,}), submitted at once; "
             f"KV pool of {budget / 2**30:g} GiB.", "",
             "| KV cache | blocks | concurrent seqs (mean / peak) | output tok/s | vs model dtype | decode share "
             "| preemptions |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["runs"]:
        row["speedup"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
        lines.append(f"| {row['kv_cache_dtype']} ({row['kv_dtype']}) | {row['num_blocks']:,} | "
                     f"{row['mean_concurrent_seqs']:.1f} / {row['peak_concurrent_seqs']} | "
                     f"{row['output_tokens_per_s']:,.0f} | {row['speedup']:.2f}x | {100 * row['decode_share']:.0f}% | "
                     f"{row['num_preemptions']} |")
    for row in result["runs"][1:]:
        met = "met" if row["speedup"] >= TARGET_SPEEDUP else "MISSED"
        lines.append(f"\nTarget >= {TARGET_SPEEDUP}x output tok/s with {row['kv_cache_dtype']}: {met} "
                     f"({row['speedup']:.2f}x).")
    write_json(args.out, "engine_kv_bound", result)
    Path(args.out, "engine_kv_bound.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote engine_kv_bound.json and .md in {args.out}")
    return 0
