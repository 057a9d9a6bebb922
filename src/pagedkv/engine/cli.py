"""`pagedkv generate`: complete prompts from the command line through the engine.

    pagedkv generate "The capital of France is" --max-tokens 16
    pagedkv generate --chat "What is the capital of France?"
    pagedkv generate --file prompts.txt --json > out.jsonl      # one prompt per line, with a progress bar
    cat prompts.txt | pagedkv generate -                         # prompts from stdin
    pagedkv generate --model random:tiny-llama --token-ids "1 2 3"   # a model without a tokenizer

Every flag is checked (and SamplingParams built), and the model argument resolved, before the
model loads. Startup is quiet (no weight-loading bar, no tokenizer warnings) unless -v.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings

from pagedkv.cli import ArgumentParser, add_engine_arguments, offload_options
from pagedkv.errors import InvalidArgumentError


def build_parser(prog: str = "pagedkv generate") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Generate for each PROMPT (or a chat turn with --chat) and "
                            "print the completions. Prompts come from the arguments, --file, or stdin ('-').")
    source = parser.add_argument_group("prompts")
    source.add_argument("prompts", nargs="*", metavar="PROMPT",
                        help="prompts to complete; '-' (or none, with stdin piped) reads one prompt per line "
                             "from stdin")
    source.add_argument("--file", metavar="PATH", help="read one prompt per line from PATH (blank lines skipped)")
    source.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    source.add_argument("--token-ids", action="store_true",
                        help="each prompt is token ids separated by spaces or commas ('1 2 3'), and completions "
                             "print as token ids: for random:NAME models, which have no tokenizer")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default 1)")
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all "
                                                               "(default 0)")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    sampling.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: none)")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="HF id, local path, .gguf file or random:NAME (random weights, no tokenizer: use "
                                                      "--token-ids) (default: "
                                                      "the embedded SmolLM2-135M-Instruct)")
    add_engine_arguments(engine)
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    output.add_argument("--no-progress", action="store_true", help="no progress bar (shown for 2+ prompts)")
    output.add_argument("-v", "--verbose", action="store_true",
                        help="log startup: weight loading, tokenizer warnings, the KV pool size")
    return parser


def read_prompts(args: argparse.Namespace, stdin=None) -> list[str]:
    """The prompts: the arguments ('-' is stdin, one per line), then --file's lines; blank lines skipped."""
    stdin = sys.stdin if stdin is None else stdin
    names = args.prompts
    if not names and args.file is None and not stdin.isatty():
        names = ["-"]  # `cat prompts.txt | pagedkv generate`
    prompts: list[str] = []
    for prompt in names:
        prompts += [line.rstrip("\n") for line in stdin if line.strip()] if prompt == "-" else [prompt]
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as handle:
                prompts += [line.rstrip("\n") for line in handle if line.strip()]
        except OSError as error:
            raise InvalidArgumentError(f"--file {args.file}: {error.strerror or error}") from None
    if not prompts:
        raise InvalidArgumentError("no prompts: pass PROMPT arguments, --file PATH, or '-' to read stdin")
    return prompts


def parse_token_ids(prompt: str) -> list[int]:
    """'1 2 3' or '1,2,3' as [1, 2, 3]; an `InvalidArgumentError` naming the prompt otherwise."""
    parts = prompt.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        raise InvalidArgumentError(f"--token-ids: expected token ids separated by spaces or commas, got {prompt!r}")
    return [int(part) for part in parts]


def check_prompt_kind(args: argparse.Namespace) -> None:
    """Refuse, before the model loads, text prompts for a model without a tokenizer, and --chat with --token-ids."""
    if args.token_ids and args.chat:
        raise InvalidArgumentError("--chat needs text prompts and a chat template; it cannot take --token-ids")
    if args.model is not None and args.model.startswith("random:") and not args.token_ids:
        raise InvalidArgumentError(f"{args.model} has random weights and no tokenizer: pass prompts as token ids "
                                   f"with --token-ids (e.g. --token-ids \"1 2 3\")")


def quiet_startup() -> None:
    """No weight-loading bars, tokenizer warnings or info logs (what -v turns back on)."""
    warnings.filterwarnings("ignore")
    logging.getLogger("pagedkv").setLevel(logging.WARNING)
    try:
        import transformers
        from huggingface_hub.utils import disable_progress_bars

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        disable_progress_bars()
    except ImportError:  # without the hf extra there is nothing to silence
        pass


def main(argv: list[str] | None = None, prog: str = "pagedkv generate") -> int:
    """Generate for each prompt and print the completions (or JSON lines)."""
    args = build_parser(prog).parse_args(argv)

    from pagedkv.engine.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    prompts = read_prompts(args)
    check_prompt_kind(args)
    inputs = [parse_token_ids(p) for p in prompts] if args.token_ids else prompts

    from pagedkv.models.loader import check_model_argument

    check_model_argument(args.model)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    else:
        quiet_startup()

    from pagedkv.engine.llm import LLM

    llm = LLM(args.model, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, device=args.device,
              dtype=args.dtype, max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
              data_parallel_size=args.data_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
              enforce_eager=args.enforce_eager, mixed_step_graphs=args.mixed_step_graphs, **offload_options(args))
    use_tqdm = len(prompts) > 1 and not args.no_progress
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=use_tqdm)
    else:
        outputs = llm.generate(inputs, params, use_tqdm=use_tqdm)
    for prompt, output in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "error": output.error,
                              "completions": [{"text": c.text, "token_ids": c.token_ids,
                                               "finish_reason": c.finish_reason} for c in output.outputs]}))
            continue
        print(f"### {prompt}")
        if output.error:
            refused = any(c.finish_reason == "rejected" for c in output.outputs)
            print(f"({'rejected' if refused else 'failed'}: {output.error})")
        for number, completion in enumerate(output.outputs, 1):
            if len(output.outputs) > 1:
                print(f"--- completion {number} of {len(output.outputs)}")
            body = " ".join(map(str, completion.token_ids)) if args.token_ids else completion.text
            print(body + f"\n[finish: {completion.finish_reason}, {len(completion.token_ids)} tokens]")
    llm.shutdown()  # a KV disk tier writes its prefixes for the next run
    return 0
