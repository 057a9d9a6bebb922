"""The prefill kernels in the engine: TTFT of a 2,048-token prompt and greedy tokens, per kernel.

    PYTHONPATH=src python3 benchmarks/tools/split_prefill_engine_ab.py [--layers 4] [--model llama3-8b] [--out DIR]

A random-weight model of the named architecture (Llama-3-8B by default, cut to `--layers` so
that it builds in seconds; attention per layer is the real model's) runs one engine with
mixed-step graphs off (the prefill kernels serve eager prefill steps only). Each round sets
PAGEDKV_PREFILL_KERNEL (read on every prefill call) to "paged", "split" then "gluon" (the
Hopper kernel; elsewhere it falls back to split) and times `generate(max_tokens=1)` of fresh
2,048-token prompts (fresh, so the prefix cache never hits): the engine's time to first token,
wall clock. It counts the split and Gluon kernels' launches (so a switch is seen to switch) and
compares 32 greedy tokens of a few prompts under each kernel against the paged kernel's (bf16
arithmetic differs in rounding, so on random weights a near tie can flip a token; the count is
reported, not asserted). A second engine with the default mixed-step graphs ("full": the
unified kernel inside the step's graph) times the same prompts for reference.
Prints a table; writes engine_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a RANDOM_CONFIGS name")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/split_prefill_engine_ab")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from pagedkv import LLM, SamplingParams
    from pagedkv.kernels import triton_prefill_split
    from pagedkv.models.loader import random_model

    from pagedkv.kernels import gluon_prefill

    launches = {"split": 0, "gluon": 0}

    def counting(module, name, kind):
        launch = getattr(module, name)

        def counted(*a, **k):
            launches[kind] += 1
            return launch(*a, **k)
        setattr(module, name, counted)

    counting(triton_prefill_split, "triton_split_prefill_attention", "split")
    counting(gluon_prefill, "gluon_prefill_attention", "gluon")
    model = random_model(args.model, torch.bfloat16, "cuda", num_hidden_layers=args.layers)
    # Eager steps: a step captured in a mixed-step graph runs the unified kernel, never paged_prefill_attention.
    options = dict(hf_model=model, kv_cache_memory=8 * 2**30, max_model_len=4096,
                   max_num_batched_tokens=args.prompt_tokens, max_num_seqs=16)
    llm = LLM(**options, mixed_step_graphs="off")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n=args.prompt_tokens):
        return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    kernels = ("paged", "split", "gluon")
    ttft = {kernel: [] for kernel in kernels}
    counts = {}
    for kernel in kernels:  # warm-up: compile every kernel
        os.environ["PAGEDKV_PREFILL_KERNEL"] = kernel
        llm.generate([prompt()], first)
    for _ in range(args.rounds):
        for kernel in kernels:
            os.environ["PAGEDKV_PREFILL_KERNEL"] = kernel
            before = dict(launches)
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt()], first)
            torch.cuda.synchronize()
            ttft[kernel].append((time.perf_counter() - start) * 1e3)
            counts[kernel] = {kind: launches[kind] - before[kind] for kind in launches}
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [prompt(n) for n in (2048, 700, 129)]
    tokens = {}
    for kernel in kernels:
        os.environ["PAGEDKV_PREFILL_KERNEL"] = kernel
        tokens[kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    same = {kernel: sum(a == b for p, s in zip(tokens["paged"], tokens[kernel]) for a, b in zip(p, s))
            for kernel in kernels[1:]}
    os.environ.pop("PAGEDKV_PREFILL_KERNEL")
    del llm
    graphed = LLM(**options)
    graphed.generate([prompt()], first)
    full = []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graphed.generate([prompt()], first)
        torch.cuda.synchronize()
        full.append((time.perf_counter() - start) * 1e3)
    result = {"model": args.model, "layers": args.layers, "prompt_tokens": args.prompt_tokens,
              "ttft_ms": {k: statistics.median(v) for k, v in ttft.items()}, "ttft_samples_ms": ttft,
              "ttft_full_graphs_ms": statistics.median(full), "ttft_full_graphs_samples_ms": full,
              "launches_per_prompt": counts, "greedy_tokens_equal_to_paged": same,
              "greedy_tokens": sum(len(t) for t in tokens["paged"]), "gpu": torch.cuda.get_device_name(),
              "commit": os.environ.get("PAGEDKV_COMMIT", "")}
    (args.out / "engine_ab.json").write_text(json.dumps(result, indent=1))
    print(f"{args.model} x {args.layers} layers, {args.prompt_tokens}-token prompt, median of {args.rounds}:")
    for kernel in kernels:
        print(f"  {kernel:6s} TTFT {result['ttft_ms'][kernel]:7.2f} ms   launches per prompt {counts[kernel]}")
    print(f"  full graphs (unified kernel) TTFT {result['ttft_full_graphs_ms']:7.2f} ms")
    print(f"  greedy tokens equal to the paged kernel's (of {result['greedy_tokens']}): {same}")


if __name__ == "__main__":
    main()
