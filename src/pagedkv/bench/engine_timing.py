"""Timing one engine run: every request submitted at once, stepped to completion, tokens over wall time.

Shared by the workloads of `pagedkv bench engine` (the nano-vllm preset in `bench.engine`,
the KV-bound preset in `bench.engine_kv_bound`).
"""

from __future__ import annotations

import time

import torch


def decode_share(steps: list[dict]) -> float:
    """Seconds of steps that ran no prefill token over the seconds of all steps (0 for no steps)."""
    total = sum(step["seconds"] for step in steps)
    return sum(step["seconds"] for step in steps if not step["prefill_tokens"]) / total if total else 0.0


def timed_generate(llm, prompts, output_lens, record: list | None = None) -> dict:
    """Generate `output_lens[i]` tokens for each prompt (greedy, ignore_eos) in one `llm.generate`; time it.

    Returns wall time, output tokens, output tok/s and the engine's preemptions so far. With
    `record`, appends each step's shape and time (prefill tokens, decode rows, KV tokens, seconds).
    """
    from pagedkv.engine.sampling_params import SamplingParams

    engine = llm.engine
    if record is not None:
        def observe(out, seconds):
            shape = out.shape
            record.append({"prefill_tokens": shape.prefill_tokens, "decode_seqs": shape.decode_seqs,
                           "kv_tokens": shape.kv_tokens, "seconds": seconds})
        engine.on_step = observe
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    engine.on_step = None
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "num_output_tokens": generated, "output_tokens_per_s": generated / elapsed,
            "num_preemptions": llm.stats()["num_preemptions"]}
