"""`pagedkv generate`: complete prompts from the command line through the engine."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None, prog: str = "pagedkv generate") -> int:
    """Generate for each PROMPT (or a chat turn with --chat) and print the completions."""
    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument("--model", default=None, help="HF id, local path, .gguf file or random:NAME (default: "
                                                      "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="KV pool budget: a fraction of free GPU memory, or bytes if > 1")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = parser.parse_args(argv)

    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling import SamplingParams

    memory = args.kv_cache_memory
    if memory is not None and memory > 1:
        memory = int(memory)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    llm = LLM(args.model, block_size=args.block_size, kv_cache_memory=memory, device=args.device, dtype=args.dtype)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, output in zip(args.prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "error": output.error,
                              "completions": [{"text": c.text, "token_ids": c.token_ids,
                                               "finish_reason": c.finish_reason} for c in output.outputs]}))
            continue
        print(f"### {prompt}")
        if output.error:
            print(f"(rejected: {output.error})")
        for completion in output.outputs:
            print(completion.text + f"\n[finish: {completion.finish_reason}, {len(completion.token_ids)} tokens]")
    return 0
