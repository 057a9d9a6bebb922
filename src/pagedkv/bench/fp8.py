"""`pagedkv bench fp8`: what an FP8 KV cache costs in accuracy, measured on the embedded SmolLM2-135M.

Two measurements, FP8 KV against model-dtype KV on the same model (CPU, fp32 weights):

1. Perplexity on a fixed English text available offline: the module docstrings of the Python
   standard library (`ast.get_docstring` of every top-level `*.py` module, modules in sorted
   order, joined by blank lines), tokenized, first `--tokens` tokens. The text depends only on
   the Python version, which the JSON records with the text's SHA-256. It is scored in
   non-overlapping windows of `--window` tokens; each window runs through a `PagedCache` in
   chunks of `--chunk` tokens, so every chunk attends to the earlier chunks' K/V as stored in
   the pool (quantized, for FP8) and to its own, written first and read back the same way.
2. Greedy agreement: the demo's questions (`pagedkv.demo.DEMO_QUESTIONS`, chat template)
   through the engine with each KV dtype; per prompt, the first output token where FP8
   diverges from model-dtype KV (None: identical).

Rows: model dtype, each FP8 format with the default scales (calibration on the built-in text,
`pagedkv.hf.kv_scales`), e4m3 with unit scales (vLLM's default without a calibrated
checkpoint) to show what calibration buys, and e4m3 simulated inside HF's own attention (K/V
quantized and dequantized with the same scales, then sdpa, no pagedkv code on the path): what
the format itself costs, against which pagedkv's kernels should add nothing. Writes
`fp8_accuracy.json` and `fp8_accuracy.md`.
"""

from __future__ import annotations

import ast
import hashlib
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

from pagedkv.cli import ArgumentParser
from pagedkv.results import add_out_argument

#: The issue's target: FP8 perplexity at most 1% over model-dtype KV.
TARGET_PPL_INCREASE = 0.01


def stdlib_docstring_text() -> tuple[str, int]:
    """(text, number of modules): every top-level stdlib module's docstring, sorted by file name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            docs.append(doc)
    return "\n\n".join(docs), len(docs)


def eval_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of `stdlib_docstring_text()` (ValueError if the text is shorter)."""
    text, _ = stdlib_docstring_text()
    ids = tokenizer(text)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"the stdlib docstrings give {len(ids):,} tokens, fewer than the {num_tokens:,} asked for")
    return list(ids[:num_tokens])


def make_pool(model, kv_cache_dtype: str, num_tokens: int, block_size: int, tokenizer=None, scales=None):
    """A `PagePool` for one window of `num_tokens` (scales: calibrated unless given)."""
    from pagedkv.hf import PagePool

    return PagePool.for_model(model, num_blocks=-(-num_tokens // block_size), block_size=block_size,
                              kv_cache_dtype=kv_cache_dtype, scales=scales, tokenizer=tokenizer)


@torch.inference_mode()
def window_nll(model, pool, window: list[int], chunk: int) -> tuple[float, int]:
    """(summed negative log-likelihood, predictions) of next-token prediction over one window, chunk by chunk."""
    from pagedkv.hf import PagedCache

    total, count = 0.0, 0
    targets = torch.tensor(window[1:])
    with PagedCache(pool) as cache:
        for start in range(0, len(window), chunk):
            ids = torch.tensor([window[start:start + chunk]], device=model.device)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
            wanted = targets[start:start + ids.shape[1]]  # the last position of the window predicts nothing
            logprobs = torch.log_softmax(logits[:wanted.shape[0]], dim=-1)
            total -= float(logprobs.gather(1, wanted[:, None].to(logprobs.device)).sum())
            count += wanted.shape[0]
    return total, count


def perplexity(model, pool, token_ids: list[int], window: int, chunk: int) -> float:
    """exp(mean NLL) over non-overlapping windows of `token_ids` (the last partial window included)."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids), window):
        nll, n = window_nll(model, pool, token_ids[start:start + window], chunk)
        total, count = total + nll, count + n
    pool.check_integrity()
    return math.exp(total / count)


@torch.inference_mode()
def simulated_perplexity(model, scales, dtype: torch.dtype, token_ids: list[int], window: int) -> float:
    """Perplexity with K/V quantized and dequantized inside HF's sdpa attention (no PagedCache, no pagedkv kernels)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pagedkv.kernels.fp8 import dequantize, quantize

    def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x [B, Hkv, T, D]
        rows = x.transpose(1, 2)
        return dequantize(quantize(rows, scale, dtype), scale).transpose(1, 2).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        return sdpa_attention_forward(module, query, round_trip(key, scales.k_scale[layer]),
                                      round_trip(value, scales.v_scale[layer]), attention_mask, **kwargs)

    AttentionInterface.register("pagedkv_fp8_simulated", attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("pagedkv_fp8_simulated")
    total, count = 0.0, 0
    try:
        for start in range(0, len(token_ids), window):
            ids = torch.tensor([token_ids[start:start + window]], device=model.device)
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            total -= float(logprobs.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    finally:
        model.set_attn_implementation(previous)
    return math.exp(total / count)


def greedy_agreement(model, tokenizer, kv_cache_dtypes: list[str], max_tokens: int, num_prompts: int | None = None,
                     scales: dict | None = None) -> dict:
    """Greedy outputs of the demo questions with each KV dtype; where each FP8 run first differs from "auto"."""
    from pagedkv.demo import DEMO_QUESTIONS
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    questions = DEMO_QUESTIONS[:num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = {}
    for kv_cache_dtype in ["auto", *kv_cache_dtypes]:
        llm = LLM(hf_model=model, tokenizer=tokenizer, kv_cache_memory=64 * 2**20, kv_cache_dtype=kv_cache_dtype)
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        outputs[kv_cache_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    rows = []
    for i, question in enumerate(questions):
        reference = outputs["auto"][i]
        row = {"question": question, "num_tokens": len(reference), "first_divergence": {}}
        for kv_cache_dtype in kv_cache_dtypes:
            got = outputs[kv_cache_dtype][i]
            first = next((j for j, (a, b) in enumerate(zip(got, reference)) if a != b), None)
            if first is None and len(got) != len(reference):
                first = min(len(got), len(reference))
            row["first_divergence"][kv_cache_dtype] = first
        rows.append(row)
    texts = {dtype: [tokenizer.decode(ids, skip_special_tokens=True) for ids in outs]
             for dtype, outs in outputs.items()}
    return {"max_tokens": max_tokens, "rows": rows, "texts": texts}


def _markdown(result: dict) -> str:
    prov, text = result["provenance"], result["text"]
    lines = [f"# FP8 KV accuracy: SmolLM2-135M-Instruct (embedded), {result['model_dtype']} weights on "
             f"{prov['device']}", "",
             f"Date {prov['date']}, commit {prov['commit']}, Python {prov['python']}.", "",
             f"Perplexity on {result['num_tokens']:,} tokens of the Python {text['python']} standard library's "
             f"module docstrings ({text['num_modules']} modules, sorted; text SHA-256 {text['sha256'][:16]}...), "
             f"non-overlapping windows of {result['window']} tokens, fed through `PagedCache` in chunks of "
             f"{result['chunk']} (every chunk reads the K/V earlier chunks stored in the pool). Target: FP8 "
             f"perplexity at most {TARGET_PPL_INCREASE:.0%} over model-dtype KV.", "",
             "| KV cache | scales | perplexity | vs model dtype | target |", "|---|---|---:|---:|---|"]
    for row in result["perplexity"]:
        delta = row["increase"]
        verdict = "-" if delta is None else ("met" if delta <= TARGET_PPL_INCREASE else "MISSED")
        lines.append(f"| {row['kv_cache_dtype']} | {row['scales']} | {row['perplexity']:.4f} | "
                     f"{'-' if delta is None else f'{100 * delta:+.3f}%'} | {verdict} |")
    greedy = result["greedy"]
    dtypes = list(greedy["rows"][0]["first_divergence"]) if greedy["rows"] else []
    lines += ["", f"Greedy agreement with model-dtype KV on the demo questions ({greedy['max_tokens']} new tokens "
              "at most): the first output token where each FP8 run differs ('-': identical).", "",
              "| question | tokens | " + " | ".join(f"{d} first divergence" for d in dtypes) + " |",
              "|---|---:|" + "---:|" * len(dtypes)]
    for row in greedy["rows"]:
        cells = ["-" if row["first_divergence"][d] is None else str(row["first_divergence"][d]) for d in dtypes]
        lines.append(f"| {row['question']} | {row['num_tokens']} | " + " | ".join(cells) + " |")
    if result.get("sanity"):
        lines += ["", result["sanity"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str = "pagedkv bench fp8") -> int:
    """Measure FP8 KV accuracy on CPU; print the tables and write fp8_accuracy.json / .md."""
    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20480, help="tokens of the docstring text (default %(default)s)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window (default %(default)s)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    parser.add_argument("--kv-dtypes", default="fp8_e4m3,fp8_e5m2", help="FP8 formats to compare (default %(default)s)")
    parser.add_argument("--no-unit-scales", action="store_true", help="skip the uncalibrated (scale 1) e4m3 row")
    parser.add_argument("--no-simulated", action="store_true",
                        help="skip the e4m3 row simulated inside HF's attention (no pagedkv code)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="greedy tokens per demo question (default %(default)s)")
    add_out_argument(parser, "fp8_accuracy.json and .md")
    args = parser.parse_args(argv)

    from pagedkv.hf import load_model, load_tokenizer
    from pagedkv.kernels.fp8 import KVScales, check_kv_cache_dtype
    from pagedkv.results import provenance, write_json

    kv_dtypes = [check_kv_cache_dtype(name) for name in args.kv_dtypes.split(",") if name]
    started = time.perf_counter()
    model, tokenizer = load_model(None, torch.float32, "cpu"), load_tokenizer(None)
    text, num_modules = stdlib_docstring_text()
    token_ids = eval_token_ids(tokenizer, args.tokens)
    result = {"benchmark": "fp8_accuracy", "model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized)",
              "model_dtype": "float32", "num_tokens": len(token_ids), "window": args.window, "chunk": args.chunk,
              "block_size": args.block_size, "provenance": provenance("cpu"),
              "text": {"source": "ast.get_docstring of every top-level stdlib *.py module, sorted by file name",
                       "python": sys.version.split()[0], "num_modules": num_modules,
                       "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}}
    runs = [("auto", "-", None)] + [(name, "calibrated", None) for name in kv_dtypes]
    if not args.no_unit_scales and "fp8_e4m3" in kv_dtypes:
        num_layers = model.config.num_hidden_layers
        runs.append(("fp8_e4m3", "unit (uncalibrated)",
                     KVScales.unit(num_layers, model.config.num_key_value_heads)))
    rows, baseline = [], None
    for kv_cache_dtype, scales_name, scales in runs:
        pool = make_pool(model, kv_cache_dtype, args.window, args.block_size, tokenizer, scales)
        tick = time.perf_counter()
        ppl = perplexity(model, pool, token_ids, args.window, args.chunk)
        baseline = ppl if baseline is None else baseline
        row = {"kv_cache_dtype": kv_cache_dtype, "scales": scales_name, "perplexity": ppl,
               "increase": None if kv_cache_dtype == "auto" else ppl / baseline - 1,
               "seconds": time.perf_counter() - tick}
        if kv_cache_dtype != "auto":
            row["scales_source"] = pool.kv.scales_source
            row["k_scale_range"] = [float(pool.kv.k_scale.min()), float(pool.kv.k_scale.max())]
            row["v_scale_range"] = [float(pool.kv.v_scale.min()), float(pool.kv.v_scale.max())]
        rows.append(row)
        increase = "" if row["increase"] is None else f" ({100 * row['increase']:+.3f}%)"
        print(f"{kv_cache_dtype:<10} {row['scales']:<20} perplexity {ppl:.4f}{increase}  [{row['seconds']:.0f} s]",
              flush=True)
    if not args.no_simulated and "fp8_e4m3" in kv_dtypes:
        from pagedkv.hf.cache import kv_scales_for

        tick = time.perf_counter()
        ppl = simulated_perplexity(model, kv_scales_for(model, torch.float8_e4m3fn, tokenizer=tokenizer),
                                   torch.float8_e4m3fn, token_ids, args.window)
        rows.append({"kv_cache_dtype": "fp8_e4m3", "scales": "calibrated, simulated in HF sdpa (no pagedkv)",
                     "perplexity": ppl, "increase": ppl / baseline - 1, "seconds": time.perf_counter() - tick})
        print(f"fp8_e4m3 simulated in HF sdpa: perplexity {ppl:.4f} ({100 * rows[-1]['increase']:+.3f}%)", flush=True)
    result["perplexity"] = rows

    # Sanity: the model-dtype PagedCache path against HF's own attention (sdpa, no cache) on the first window.
    window = torch.tensor([token_ids[:args.window]])
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            plain = model(input_ids=window).logits[0].float()
    finally:
        model.set_attn_implementation("pagedkv")
    pool = make_pool(model, "auto", args.window, args.block_size)
    from pagedkv.hf import PagedCache

    with torch.inference_mode(), PagedCache(pool) as cache:
        paged = torch.cat([model(input_ids=window[:, s:s + args.chunk], past_key_values=cache, use_cache=True)
                           .logits[0].float() for s in range(0, args.window, args.chunk)])
    result["sanity"] = ("Check: model-dtype KV through `PagedCache` in chunks vs HF sdpa without a cache, first "
                        f"window: max |logit difference| {float((paged - plain).abs().max()):.2e}.")
    print(result["sanity"])

    result["greedy"] = greedy_agreement(model, tokenizer, kv_dtypes, args.max_tokens)
    for row in result["greedy"]["rows"]:
        print(f"{row['question']:<50} {row['num_tokens']:>3} tokens; first divergence "
              + ", ".join(f"{d}: {'-' if i is None else i}" for d, i in row["first_divergence"].items()))
    result["elapsed_s"] = time.perf_counter() - started
    path = write_json(args.out, "fp8_accuracy", result)
    md = Path(args.out, "fp8_accuracy.md")
    md.write_text(_markdown(result))
    print(_markdown(result))
    print(f"wrote {path} and {md} in {result['elapsed_s']:.0f} s")
    return 0
