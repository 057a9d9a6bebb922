"""`pagedkv bench serve`: load an OpenAI-compatible server and measure TTFT, TPOT, ITL and throughput.

    pagedkv bench serve --smoke                          # tiny and fast, against http://127.0.0.1:8000
    pagedkv bench serve --dataset random --random-input-len 1024 --random-output-len 256 \\
        --num-prompts 500 --request-rate 2,4,8,inf --slo ttft:500,tpot:50 --ignore-eos

Works against any server with /v1/completions (or /v1/chat/completions with --endpoint chat),
pagedkv or a peer, with vLLM's `bench serve` flags. Prompts go as token ids where the server
takes them, else as text. Streams by default (SSE, usage requested) and writes `serve.json`
and `serve.png` to --out. The pieces: `datasets` (what to send), `runner` (when to send it),
`client` (HTTP and timing), `metrics` (what it measured), `report` (table and figure).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

from pagedkv.bench.serve.runner import DATASETS, ServeBenchConfig, run_benchmark
from pagedkv.cli import ArgumentParser
from pagedkv.results import add_out_argument


#: --smoke: seconds against a tiny model on CPU; flags given explicitly still win.
SMOKE_DEFAULTS = dict(dataset="random", num_prompts=8, random_input_len=16, random_output_len=8,
                      random_range_ratio=0.5, vocab_size=500, request_rate="50,inf", max_concurrency=4,
                      ignore_eos=True, slo="ttft:2000,tpot:1000")


def parse_rates(text: str) -> tuple[float, ...]:
    """'1,2.5,inf' -> (1.0, 2.5, inf): one run per rate."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(rate > 0 and not math.isnan(rate) for rate in rates):
        raise argparse.ArgumentTypeError(f"expected request rates > 0 like 2,4,inf, got {text!r}")
    return rates


def build_parser(prog: str = "pagedkv bench serve") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="(default %(default)s)")
    server.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    server.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions or /v1/chat/completions (default %(default)s)")
    server.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    server.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                        help="completions prompts as token ids or text (default auto: ids where the server "
                             "takes them)")
    server.add_argument("--no-stream", dest="stream", action="store_false",
                        help="ask for whole responses (E2E only: no TTFT, TPOT or ITL)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default="random", help="(default %(default)s)")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests per run (default %(default)s; "
                      "prefix-chat sends num-conversations x turns)")
    data.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (default %(default)s)")
    data.add_argument("--random-output-len", type=int, default=128, help="max_tokens (default %(default)s)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [L*(1-r), L*(1+r)] (default %(default)s)")
    data.add_argument("--vocab-size", type=int, default=10_000,
                      help="random token ids are drawn below this (default %(default)s)")
    data.add_argument("--dataset-path", default=None,
                      help="ShareGPT-format JSON for --dataset sharegpt (default: a small synthetic sample); for "
                           "--dataset ids, a JSON list of {\"prompt_token_ids\": [...], \"max_tokens\": N}, "
                           "replayed in order")
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="max_tokens instead of each reply's")
    data.add_argument("--num-prefixes", type=int, default=4, help="prefix-chat system prompts (default %(default)s)")
    data.add_argument("--prefix-len", type=int, default=256, help="tokens per system prompt (default %(default)s)")
    data.add_argument("--num-conversations", type=int, default=16, help="prefix-chat conversations "
                      "(default %(default)s)")
    data.add_argument("--turns", type=int, default=3, help="user turns per conversation (default %(default)s)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf",
                      help="requests/s, Poisson; a comma-separated list runs once per rate (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 more even (default %(default)s)")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    load.add_argument("--slo", default=None, help="goodput bounds in ms, e.g. ttft:200,tpot:50 (also e2el)")
    load.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past EOS (vLLM's extra)")
    load.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="8 short requests at two rates, for CI")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_out_argument(parser, "serve.json and serve.png")
    return parser


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The typed config the parsed flags describe."""
    from pagedkv.bench.serve.metrics import parse_slo

    try:
        rates = parse_rates(args.request_rate)
    except argparse.ArgumentTypeError as error:
        from pagedkv.errors import InvalidArgumentError

        raise InvalidArgumentError(str(error)) from None
    return ServeBenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        dataset=args.dataset, num_prompts=args.num_prompts, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        vocab_size=args.vocab_size, dataset_path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, num_conversations=args.num_conversations,
        num_turns=args.turns, prompt_format=args.prompt_format, request_rates=rates, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, slo_ms=tuple(parse_slo(args.slo).items()), seed=args.seed,
        ignore_eos=args.ignore_eos, stream=args.stream, progress=not args.disable_tqdm)


def parse_args(argv: list[str] | None, prog: str = "pagedkv bench serve") -> argparse.Namespace:
    """The flags in `argv`, with `SMOKE_DEFAULTS` under the explicit ones when --smoke is given."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE_DEFAULTS)
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None, prog: str = "pagedkv bench serve") -> int:
    """Run the benchmark, print a table per rate, and write `<out>/serve.json` and `<out>/serve.png`.

    Exit status 0, or 1 when any request failed (the table and files are written either way).
    """
    from pagedkv.results import provenance, write_json
    from pagedkv.bench.serve.report import format_run, write_png

    args = parse_args(argv, prog)
    config = config_from_args(args)
    result = asyncio.run(run_benchmark(config))
    for run in result["runs"]:
        print(format_run(run))
    flags = {**vars(args), "api_key": bool(args.api_key),  # never the key itself
             "request_rate": [run["request_rate"] for run in result["runs"]]}
    payload = {"benchmark": "serve", "provenance": provenance(), "base_url": config.base_url, "config": flags,
               **result}
    print(f"wrote {write_json(args.out, 'serve', payload)}")
    png = write_png(result, Path(args.out) / "serve.png")
    print(f"wrote {png}" if png else "matplotlib not installed: no serve.png")
    return 0 if all(run["summary"]["num_failed"] == 0 for run in result["runs"]) else 1
