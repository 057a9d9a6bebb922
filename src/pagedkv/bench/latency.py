"""`pagedkv bench latency`: decode step time at batch 1, 8, 64 and 256, against the step's roofline.

Each case runs B requests of a 128-token prompt and 256 new tokens (`ignore_eos`, greedy)
through the engine and takes the median of its decode-only steps. A step's roofline is the
bytes it must read, the weights once plus every sequence's K/V, over the device copy bandwidth
measured in the same run:

    roofline_s = (weight_bytes + kv_tokens * kv_bytes_per_token) / copy_bandwidth

Each step's wall time is split by the engine's own timers (`LLMEngine.step_timings`): host
phases (schedule, build, launch, update) and the wait for the device. Host time that is not
spent waiting is time the device could have been working, so it is reported as its share of the
step. Beside pagedkv, the same run times HF `generate` at batch 1 with a StaticCache and
`torch.compile` (the fastest HF path), so the single-stream ratio is measured, not quoted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from pagedkv.bench.common import require_cuda
from pagedkv.engine.outputs import STEP_PHASES
from pagedkv.results import add_out_argument, provenance, write_json

PROMPT_TOKENS = 128
NEW_TOKENS = 256


def copy_bandwidth(num_bytes: int = 2 * 2**30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of `repeats`."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * num_bytes / statistics.median(times)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied embedding counts once)."""
    seen, total = set(), 0
    for param in module.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def _median(values):
    return statistics.median(values) if values else float("nan")


def decode_case(llm, batch: int, bandwidth: float, weights: int, kv_bytes_per_token: int, seed: int = 0) -> dict:
    """Median decode-only step of `batch` streams, its phases and its roofline."""
    from pagedkv.engine.sampling_params import SamplingParams

    rng = random.Random(seed + batch)
    vocab = min(llm.engine.vocab_size, 10000)
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = llm.engine
    engine.step_timings = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    steps = [t for t in engine.step_timings if t.shape.prefill_tokens == 0 and t.shape.decode_seqs == batch]
    engine.step_timings = None
    step_s = _median([t.total_s for t in steps])
    kv_tokens = _median([t.shape.kv_tokens for t in steps])
    roofline_s = (weights + kv_tokens * kv_bytes_per_token) / bandwidth
    host_s = _median([t.total_s - t.wait_s for t in steps])
    return {
        "batch": batch, "num_steps": len(steps), "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
        "roofline_ms": roofline_s * 1e3, "vs_roofline": step_s / roofline_s,
        "host_ms": host_s * 1e3, "host_share": host_s / step_s,
        "phases_ms": {name: _median([getattr(t, name) for t in steps]) * 1e3
                      for name in STEP_PHASES},
        "wall_s": elapsed,
    }


def hf_compiled_batch1(model, vocab: int, seed: int = 0) -> dict:
    """HF generate, batch 1, StaticCache + torch.compile: ms per new token (decode only, prefill subtracted)."""
    from transformers import GenerationConfig

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    rng = random.Random(seed)
    ids = torch.tensor([[rng.randrange(3, min(vocab, 10000)) for _ in range(PROMPT_TOKENS)]], device="cuda")
    try:
        def run(new_tokens: int) -> float:
            config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      cache_implementation="static", eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        compile_start = time.perf_counter()
        run(NEW_TOKENS)  # compiles
        run(NEW_TOKENS)
        compile_s = time.perf_counter() - compile_start
        full = _median([run(NEW_TOKENS) for _ in range(3)])
        short = _median([run(1) for _ in range(3)])
        return {"ms_per_token": (full - short) / (NEW_TOKENS - 1) * 1e3, "compile_and_warmup_s": compile_s}
    except Exception as error:  # report, never crash the benchmark
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        model.set_attn_implementation(previous)


def run_model(name: str, batches: list[int], bandwidth: float, impls: list[str], console, hf_compiled: bool) -> dict:
    from pagedkv.engine.llm import LLM
    from pagedkv.models.config import kv_shape_of
    from pagedkv.models.loader import random_model

    model = random_model(name, torch.bfloat16, "cuda")
    num_layers, num_kv_heads, head_dim = kv_shape_of(model.config)
    kv_bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * 2
    result = {"model": f"random:{name} (bf16)", "kv_bytes_per_token": kv_bytes_per_token, "impls": {}}
    for impl in impls:
        top = max(batches)
        # Bytes, not blocks: a model with layer groups (sliding windows) spends one block per group per 16
        # tokens, so a block count sized for one table would hold only a fraction of the batch. 1.25x covers
        # each group's partly filled last block.
        kv_cache_memory = int(1.25 * top * (PROMPT_TOKENS + NEW_TOKENS + 32) * kv_bytes_per_token) + 2**26
        options = {"model_impl": "hf"} if impl == "hf" else {"enforce_eager": impl == "pagedkv-eager"}
        start = time.perf_counter()
        llm = LLM(hf_model=model, kv_cache_memory=kv_cache_memory, max_model_len=1024, max_num_seqs=top,
                  max_num_batched_tokens=max(2048, top), **options)
        startup_s = time.perf_counter() - start
        weights = weight_bytes(llm.engine.model)
        decode_case(llm, min(batches), bandwidth, weights, kv_bytes_per_token)  # warm-up
        rows = []
        for batch in batches:
            row = decode_case(llm, batch, bandwidth, weights, kv_bytes_per_token)
            rows.append(row)
            console.print(f"{name} {impl} batch {batch}: {row['step_ms']:.2f} ms/step "
                          f"(roofline {row['roofline_ms']:.2f}, x{row['vs_roofline']:.2f}; host not hidden "
                          f"{row['host_share']:.0%})")
        result["impls"][impl] = {"startup_s": startup_s, "weight_bytes": weights, "cases": rows}
        del llm
        torch.cuda.empty_cache()
    if hf_compiled:
        result["hf_generate_static_compiled_batch1"] = hf_compiled_batch1(model, model.config.vocab_size)
        console.print(f"{name} HF generate StaticCache+compile, batch 1: {result['hf_generate_static_compiled_batch1']}")
    del model
    torch.cuda.empty_cache()
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in results["models"]:
        for impl, data in model["impls"].items():
            batches = [c["batch"] for c in data["cases"]]
            ax.plot(batches, [c["step_ms"] for c in data["cases"]], marker="o", label=f"{model['model']} {impl}")
        cases = next(iter(model["impls"].values()))["cases"]
        ax.plot([c["batch"] for c in cases], [c["roofline_ms"] for c in cases], linestyle="--", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode step time vs roofline (dashed), {results['provenance']['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None, prog: str = "pagedkv bench latency") -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-0.6b:1,8,64,256;llama3.2-1b:1,64;llama3-8b:1,64",
                        help="NAME:batches;... (random-weight architectures)")
    parser.add_argument("--impls", default="pagedkv,pagedkv-eager,hf",
                        help="engine paths for the first model (the others run pagedkv only)")
    parser.add_argument("--no-hf-compiled", action="store_true", help="skip HF generate with StaticCache+compile")
    add_out_argument(parser, "latency.json, .md and .png")
    args = parser.parse_args(argv)
    require_cuda("pagedkv bench latency")
    console = Console()
    bandwidth = copy_bandwidth()
    console.print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    results = {"benchmark": "latency", "provenance": provenance(torch.cuda.get_device_name()),
               "copy_bandwidth_bytes_per_s": bandwidth, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
               "models": []}
    for index, spec in enumerate(args.models.split(";")):
        name, batches = spec.split(":")
        impls = args.impls.split(",") if index == 0 else ["pagedkv"]
        results["models"].append(run_model(name, [int(b) for b in batches.split(",")], bandwidth, impls, console,
                                           hf_compiled=index == 0 and not args.no_hf_compiled))
        write_json(args.out, "latency", results)
    plot(results, Path(args.out) / "latency.png")
    lines = [f"# Decode latency ({results['provenance']['device']}, {results['provenance']['date']}, "
             f"commit {results['provenance']['commit']})", "",
             f"Copy bandwidth {bandwidth / 1e12:.2f} TB/s; {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens.", "",
             "| model | path | batch | ms/step | tok/s | roofline ms | × roofline | host not hidden |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in results["models"]:
        for impl, data in model["impls"].items():
            for c in data["cases"]:
                lines.append(f"| {model['model']} | {impl} | {c['batch']} | {c['step_ms']:.2f} | "
                             f"{c['tokens_per_s']:,.0f} | {c['roofline_ms']:.2f} | {c['vs_roofline']:.2f} | "
                             f"{c['host_share']:.0%} |")
        hf = model.get("hf_generate_static_compiled_batch1")
        if hf:
            lines.append(f"| {model['model']} | HF generate, StaticCache + compile | 1 | "
                         f"{hf.get('ms_per_token', float('nan')):.2f} | | | | |" if "error" not in hf else
                         f"| {model['model']} | HF generate, StaticCache + compile | 1 | error: {hf['error'][:80]} |"
                         " | | | |")
    Path(args.out, "latency.md").write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines))
    print(f"wrote latency.json, .md and .png in {args.out}")
    return 0
