"""`pagedkv serve [MODEL]`: build an engine from the command line and serve it with uvicorn.

    pagedkv serve                                  # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
    pagedkv serve HuggingFaceTB/SmolLM2-360M-Instruct --port 8080 --api-key sk-local
"""

from __future__ import annotations

import argparse
import logging
import os
import re

from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_memory(text: str) -> int | float:
    """`--kv-cache-memory`: a fraction of free memory ('0.5') or a size ('512MiB', '2GiB', '1000000')."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.5 or a size like 512MiB, got {text!r}")
    number, unit = match.group(1), match.group(2).lower()
    if "." in number and not unit:
        return float(number)
    return int(float(number) * _UNITS[unit])


def build_parser(prog: str = "pagedkv serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server: /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics.")
    parser.add_argument("model", nargs="?", default=None,
                        help="HF id, local path, .gguf file or random:NAME (default: embedded SmolLM2-135M-Instruct)")
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s: this machine only)")
    http.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    http.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGEDKV_API_KEY, else none)")
    http.add_argument("--served-model-name", default=None,
                      help="the model name clients send (default: MODEL, or SmolLM2-135M-Instruct)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    engine.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: bf16 on CUDA)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    engine.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                        help="KV pool budget: a fraction of free memory (0.5) or a size (512MiB) "
                             "(default: 0.5 on CUDA, 256MiB on CPU)")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output (default: the model's limit, capped by the pool)")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step (default %(default)s)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens per step (default %(default)s)")
    engine.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                        help="what a preempted sequence does (default %(default)s)")
    engine.add_argument("--swap-space", type=parse_memory, default=256 * 2**20,
                        help="host memory for swapped blocks, swap mode (default 256MiB)")
    engine.add_argument("--watermark", type=float, default=0.01,
                        help="fraction of blocks kept free at admission (default %(default)s)")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` that the parsed arguments describe."""
    if isinstance(args.swap_space, float):
        raise ConfigError(f"--swap-space must be a size such as 256MiB, got the fraction {args.swap_space}")
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        preemption_mode=args.preemption_mode, swap_space=args.swap_space, watermark=args.watermark)


def main(argv: list[str] | None = None, prog: str = "pagedkv serve") -> int:
    """Load the model, then serve until interrupted."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = engine_config(args)  # validate the flags before loading anything

    import uvicorn

    from pagedkv.engine.engine import LLMEngine
    from pagedkv.server.app import DEFAULT_SERVED_MODEL_NAME, create_app

    engine = LLMEngine(config)
    name = args.served_model_name or args.model or DEFAULT_SERVED_MODEL_NAME
    app = create_app(engine, name, args.api_key)
    logging.getLogger("pagedkv.server").info("serving %r on http://%s:%d/v1%s", name, args.host, args.port,
                                             " (API key required)" if args.api_key else "")
    # NOTE: open streams get a few seconds to finish on shutdown; then the engine thread ends them.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
