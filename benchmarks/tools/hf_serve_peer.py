"""HF transformers' own serving paths beside `pagedkv serve`, on the same token-id requests where they allow it.

    PYTHONPATH=src python3 benchmarks/tools/hf_serve_peer.py --out DIR --model random:qwen3-0.6b \\
        --requests requests_random.json [--num-requests 64] [--device cuda]

transformers 5.17 has two candidates:
- `transformers serve` (transformers/cli/serve.py, with `--continuous-batching`): an OpenAI-style server.
  This records whether it can run here (it needs `fastapi`, `uvicorn`, `pydantic`, `openai` and `typer`)
  and what its /v1/completions takes: a text prompt only ("prompt must be a string."), so the token-id
  requests that pagedkv gets cannot be sent as they are, and a model with no tokenizer (a `random:` shape)
  cannot be served by it at all;
- `model.generate_batch(inputs=[token ids...])`: continuous batching with paged attention, in process.
  This times it on the same token ids (greedy, every request `max_new_tokens` long, EOS off) and reports
  output tok/s: the in-process peer of `pagedkv`'s offline engine, not a server.
Writes DIR/hf_serve_peer.json (with `lines`, markdown that serve_at_limit.sh puts in its summary).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
from pathlib import Path


def serve_probe() -> dict:
    """Whether `transformers serve` can start here, and what its completions endpoint accepts."""
    import transformers

    missing = [name for name in ("fastapi", "uvicorn", "pydantic", "openai", "typer")
               if importlib.util.find_spec(name) is None]
    result = {"transformers": transformers.__version__, "missing_modules": missing,
              "has_serve_command": importlib.util.find_spec("transformers.cli.serve") is not None}
    try:
        from transformers.cli.serving import completion

        source = inspect.getsource(completion)
        result["completions_take_token_ids"] = "prompt must be a string" not in source
    except Exception as error:  # noqa: BLE001 - a probe reports, never raises
        result["completions_probe_error"] = f"{type(error).__name__}: {error}"
    return result


def time_generate_batch(model_name: str, requests: list[dict], device: str | None) -> dict:
    """HF continuous batching (`generate_batch`) on these token-id prompts: output tok/s over wall time."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from pagedkv.models.loader import random_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if not model_name.startswith("random:"):
        raise SystemExit("hf_serve_peer.py times random: shapes only (no download on the GPU machine)")
    model = random_model(model_name.split(":", 1)[1], dtype=dtype, device=device, attn_implementation="sdpa")
    max_new = max(r["max_tokens"] for r in requests)
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    # On a GPU its pool is sized from free memory (the servers have stopped by then); on CPU, small.
    cb_config = None if device.startswith("cuda") else ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256)
    prompts = [r["prompt_token_ids"] for r in requests]
    model.generate_batch(inputs=prompts[:4], generation_config=config, continuous_batching_config=cb_config,
                         max_new_tokens=8)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb_config)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {"num_requests": len(prompts), "max_new_tokens": max_new, "elapsed_s": elapsed,
            "num_output_tokens": generated, "output_tokens_per_s": generated / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--requests", required=True, help="a bench serve --dataset ids file")
    parser.add_argument("--num-requests", type=int, default=None, help="the first N requests (default all)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"serve": serve_probe()}
    probe = result["serve"]
    print(f"transformers serve: missing {probe['missing_modules'] or 'nothing'}; completions take token ids: "
          f"{probe.get('completions_take_token_ids')}", flush=True)
    requests = json.loads(Path(args.requests).read_text())[:args.num_requests]
    try:
        result["generate_batch"] = time_generate_batch(args.model, requests, args.device)
        print(f"generate_batch: {result['generate_batch']['output_tokens_per_s']:,.0f} output tok/s on "
              f"{len(requests)} requests", flush=True)
    except Exception as error:  # noqa: BLE001 - the peer failing is a result, not a crash
        result["generate_batch"] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
        print(f"generate_batch failed: {result['generate_batch']['error']}", flush=True)
    batch = result["generate_batch"]
    result["lines"] = [
        f"- `transformers serve` ({probe['transformers']}): "
        + ("cannot start here: missing " + ", ".join(probe["missing_modules"]) if probe["missing_modules"]
           else "its dependencies import")
        + "; its /v1/completions takes text prompts only, so the token-id requests cannot be replayed through it, "
          "and a `random:` shape has no tokenizer to serve with.",
        f"- `generate_batch` (HF continuous batching, in process, sdpa) on the first {len(requests)} requests of "
        f"{Path(args.requests).name}: "
        + (f"{batch['output_tokens_per_s']:,.0f} output tok/s ({batch['elapsed_s']:.1f} s)" if "error" not in batch
           else f"failed: {batch['error']}")]
    (out / "hf_serve_peer.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
