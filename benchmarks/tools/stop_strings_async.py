"""What a request with stop strings cost the whole batch when it turned async scheduling off, and costs now.

nano-vllm's workload (Qwen3-0.6B shape, random weights, bf16, 256 requests of 100-1,024 tokens in and
out) three ways, each on a fresh engine after a warm-up:

    async                    async scheduling, no stop strings
    async + stop strings     every request carries a stop string (steps stay overlapped; the one token an
                             overlapped step computes past a stop is dropped)
    sync                     async scheduling off: what any live request with stop strings used to impose

The random-weight model has no tokenizer, so no stop string ever matches: the rows compare the schedule
alone. Usage (GPU): PYTHONPATH=src python3 benchmarks/tools/stop_strings_async.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pagedkv.bench.engine import nano_vllm_workload
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.models.loader import random_model
from pagedkv.results import provenance


def run(model, prompts, output_lens, async_scheduling: bool, stop: tuple[str, ...]) -> float:
    """Output tok/s of one fresh engine on the workload."""
    llm = LLM(hf_model=model, async_scheduling=async_scheduling, max_model_len=4096)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=stop) for n in output_lens]
    llm.generate(prompts[:8], params[:8])  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    torch.cuda.empty_cache()
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    model = random_model(args.model, torch.bfloat16, torch.device("cuda"))
    prompts, output_lens = nano_vllm_workload(args.requests, 100, 1024, 0, model.config.vocab_size)
    rows = {}
    for name, async_scheduling, stop in (("async", True, ()), ("async + stop strings", True, ("\n\nUser:",)),
                                         ("sync", False, ())):
        rows[name] = run(model, prompts, output_lens, async_scheduling, stop)
        print(f"{name:<22} {rows[name]:>10,.0f} output tok/s  {rows[name] / rows['async']:.3f}x async", flush=True)
    result = {"benchmark": "stop_strings_async", "model": f"random:{args.model} (bf16)",
              "provenance": provenance(torch.cuda.get_device_name()), "num_requests": args.requests,
              "output_tokens_per_s": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "stop_strings_async.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
