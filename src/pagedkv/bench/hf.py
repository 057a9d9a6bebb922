"""`pagedkv bench hf`: PagedCache against DynamicCache and StaticCache inside `model.generate`.

PageForge's setting for memory: GPT-2 124M (random weights of the real shape), fp16, 32
sequences, a 512-token budget, pages of 16 tokens.

- Memory at decode steps 5, 50 and 200: naive pre-allocation (32 x 512 tokens), DynamicCache
  (its tensors' bytes, left padding included), StaticCache (what it allocates), and
  PagedCache, both as the blocks the allocator holds and as the max_memory_allocated delta
  of the whole generate call (PagedCache's pool is allocated once, before the call, as a
  server would; the delta is what generate itself adds on top).
- Decode latency P50/P99 per generated token at batch 1 and batch 32, for every cache, for
  GPT-2 124M fp16 and a Llama-3.2-1B shape bf16, with the diagnostics of `bench.hf_latency`
  (GPU busy time, syncs, allocations, GC, launch path) and each target met or missed.
- Plots: KV memory against decode step; the two-batch lifecycle (batch 2 lands on batch 1's
  pages and the pool ends at 0).
- Sharing (`bench.hf_sharing`): beam search, parallel sampling and prompt reuse with blocks
  shared by reference count, against DynamicCache's per-sequence copies; a table, a plot and
  hf_sharing.json. `--only sharing` runs just this part, on CPU too (`--quick` for a small model);
  `--only latency` just the latency part.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedkv.bench import hf_latency
from pagedkv.bench.common import GPURequiredError
from pagedkv.bench.hf_latency import generate_tokens, prompts
from pagedkv.cli import ArgumentParser
from pagedkv.results import add_out_argument, provenance, write_json

STEPS = (5, 50, 200)


def _memory(model, pool, batch: int, prompt_len: int, budget: int) -> dict:
    """KV bytes of each approach at each decode step in STEPS."""
    from transformers import DynamicCache, StaticCache

    from pagedkv.hf.cache import PagedCache

    bytes_per_token = pool.bytes_per_token
    ids = prompts(batch, prompt_len, model.config.vocab_size, seed=1).to(model.device)
    rows = {step: {"naive_bytes": batch * budget * bytes_per_token} for step in STEPS}
    for step in STEPS:
        model.set_attn_implementation("sdpa")
        for name, make in (("dynamic", lambda: DynamicCache()),
                           ("static", lambda: StaticCache(config=model.config, max_cache_len=budget))):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            cache = make()
            generate_tokens(model, ids, cache, step)
            torch.cuda.synchronize()
            held = sum(t.numel() * t.element_size() for layer in cache.layers
                       for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
            rows[step][f"{name}_bytes"] = held
            rows[step][f"{name}_peak_delta_bytes"] = torch.cuda.max_memory_allocated() - base
            del cache
        model.set_attn_implementation("pagedkv")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cache = PagedCache(pool, max_cache_len=budget)
        generate_tokens(model, ids, cache, step)
        torch.cuda.synchronize()
        memory = cache.memory()
        rows[step]["paged_bytes"] = memory.paged_bytes
        rows[step]["paged_blocks"] = memory.num_blocks
        rows[step]["paged_peak_delta_bytes"] = torch.cuda.max_memory_allocated() - base
        rows[step]["paged_utilization"] = memory.utilization
        cache.free()
    # generate does not run the model on its last token, so after `step` decode steps each
    # sequence holds prompt_len + step tokens (the step-th new token's K/V is not yet written).
    return {str(k): v for k, v in rows.items()}


def _curve(model, pool, batch: int, prompt_len: int, steps: int, seed: int) -> tuple[list[int], list[int]]:
    """Blocks held after each forward of one generate call, and the sorted block ids it used."""
    from pagedkv.hf.cache import PagedCache

    ids = prompts(batch, prompt_len, model.config.vocab_size, seed=seed).to(model.device)
    used: list[int] = []
    cache = PagedCache(pool)

    class Probe:
        def __call__(self, input_ids, scores, **kwargs):
            used.append(pool.num_used_blocks)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    from transformers import StoppingCriteriaList

    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                   do_sample=False, past_key_values=cache, pad_token_id=0, eos_token_id=None,
                   stopping_criteria=StoppingCriteriaList([Probe()]))
    block_ids = sorted(b for t in cache.tables for b in t.block_ids)
    cache.free()
    used.append(pool.num_used_blocks)
    return used, block_ids


def _plots(out_dir: str, memory: dict, curve1: list[int], curve2: list[int], bytes_per_block: int,
           naive_bytes: int, pool, batch: int, prompt_len: int, budget: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    steps = list(range(1, budget - prompt_len))
    mb = 1e6
    bpt = pool.bytes_per_token
    block = pool.block_size
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.axhline(naive_bytes / mb, color="tab:red", label="naive pre-allocation / StaticCache (512 tokens)")
    ax.plot(steps, [batch * (prompt_len + s) * bpt / mb for s in steps], color="tab:orange",
            label="DynamicCache (exact tokens, grows by cat)")
    ax.plot(steps, [batch * -(-(prompt_len + s) // block) * block * bpt / mb for s in steps], color="tab:blue",
            label="PagedCache (16-token pages)")
    for step, row in memory.items():
        ax.scatter([int(step)], [row["paged_bytes"] / mb], color="tab:blue", zorder=3)
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV memory (MB)")
    ax.set_title(f"GPT-2 124M fp16, {batch} sequences, {prompt_len}-token prompts (dots: measured)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / "hf_memory.png"
    fig.savefig(path, dpi=120)
    paths.append(str(path))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    x1 = list(range(len(curve1)))
    ax.plot(x1, [u * bytes_per_block / mb for u in curve1], label="batch 1")
    x2 = [len(curve1) + i for i in range(len(curve2))]
    ax.plot(x2, [u * bytes_per_block / mb for u in curve2], label="batch 2 (same physical pages)")
    ax.set_xlabel("forward passes (two generate calls back to back)")
    ax.set_ylabel("pool memory held (MB)")
    ax.set_title("Two batches on one PagePool: usage returns to 0 after each")
    ax.legend()
    fig.tight_layout()
    path = Path(out_dir) / "hf_lifecycle.png"
    fig.savefig(path, dpi=120)
    paths.append(str(path))
    plt.close(fig)
    return paths


def _sharing_report(model, label: str, args) -> dict:
    """Run the sharing scenarios; print the table; write hf_sharing.json, hf_sharing.md and hf_sharing.png."""
    from pagedkv.bench.hf_sharing import measure_sharing, plot, table_lines
    from pagedkv.hf.cache import PagePool

    batches = tuple(int(b) for b in args.sharing_batches.split(","))
    block_size = 16
    blocks_per_seq = -(-(args.sharing_prompt_len + args.sharing_new_tokens) // block_size)
    pool = PagePool.for_model(model, num_blocks=2 * max(batches) * 4 * blocks_per_seq + 64, block_size=block_size)
    result = measure_sharing(model, pool, batches, args.sharing_prompt_len, args.sharing_new_tokens)
    device = torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"
    result = {"benchmark": "hf_sharing", "model": label, "dtype": str(model.dtype).removeprefix("torch."),
              "provenance": provenance(device), **result}
    title = (f"{label}, {str(model.dtype).removeprefix('torch.')}: {result['prompt_len']}-token prompts, "
             f"{result['new_tokens']} new tokens, {result['width']} beams / samples, pages of {block_size}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result, Path(args.out) / "hf_sharing.png", title)
    lines = [f"# KV memory with shared blocks ({result['provenance']['device']}, {result['provenance']['date']}, "
             f"commit {result['provenance']['commit']})", "", title, "", *table_lines(result), "",
             "vLLM paper: 37.6-55.2% less KV memory from sharing in beam search, 6.1-9.8% in parallel sampling."]
    print("\n".join(lines))
    write_json(args.out, "hf_sharing", result)
    Path(args.out, "hf_sharing.md").write_text("\n".join(lines) + "\n")
    print(f"wrote hf_sharing.json, .md and .png in {args.out}")
    return result


def _latency_report(args) -> tuple[dict, list[str]]:
    """Run the latency part (`bench.hf_latency`) on every --latency-models model; print its table."""
    gc_mode = "freeze" if args.gc_freeze else args.gc
    models = [name.strip() for name in args.latency_models.split(",") if name.strip()]
    unknown = [name for name in models if name not in hf_latency.LATENCY_MODELS]
    if unknown:
        raise SystemExit(f"unknown latency model(s) {unknown}; choose from {', '.join(hf_latency.LATENCY_MODELS)}")
    latency, labels = hf_latency.run(models, [1, args.batch], args.prompt_len, args.latency_steps, args.repeats,
                                     gc_mode, args.budget, with_static=not args.no_static,
                                     diagnose=not args.no_diagnose)
    goals = hf_latency.targets(latency)
    lines = [f"Decode latency per token: {args.latency_steps} steps x {args.repeats} runs after a warm-up run, "
             f"{args.prompt_len}-token prompts, GC {gc_mode}. Target: PagedCache <= 1.0x DynamicCache at P50 and P99.",
             "", *hf_latency.table_lines(latency, labels), ""]
    for model_name, batches in goals.items():
        for batch, goal in batches.items():
            lines.append(f"- {labels[model_name]}, batch {batch}: P50 {goal['p50_ratio']:.2f}x, P99 "
                         f"{goal['p99_ratio']:.2f}x -> {'met' if goal['met'] else 'MISSED'}")
    print("\n".join(lines))
    return {"gc_mode": gc_mode, "steps": args.latency_steps, "repeats": args.repeats, "labels": labels,
            "results": latency, "targets": goals}, lines


def main(argv: list[str] | None = None, prog: str = "pagedkv bench hf") -> int:
    """Run the benchmark; print tables; write hf.json, hf.md, hf_sharing.json/.md and PNG plots."""
    from rich.console import Console
    from rich.table import Table

    from pagedkv.hf.cache import PagePool
    from pagedkv.models.loader import load_model, parse_dtype, random_model

    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("all", "sharing", "latency"), default="all",
                        help="sharing: only the beam / parallel-sampling memory part (runs on CPU too); latency: "
                             "only the latency part (writes hf_latency.json/.md)")
    parser.add_argument("--model", default="random:gpt2",
                        help="the memory and sharing parts' model, what load_model takes (default random:gpt2)")
    parser.add_argument("--latency-models", default=",".join(hf_latency.LATENCY_MODELS),
                        help=f"comma-separated, from {', '.join(hf_latency.LATENCY_MODELS)} (random weights, each "
                             f"in its own dtype)")
    parser.add_argument("--dtype", default=None, help="default float16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer, 128-wide GPT-2 shape instead of --model (for CPU; the sharing ratios "
                             "count blocks, which do not depend on the model's width)")
    parser.add_argument("--batch", type=int, default=32, help="the memory part's batch, and the latency part's "
                                                              "second batch (after 1)")
    parser.add_argument("--budget", type=int, default=512, help="tokens per sequence (naive reservation)")
    parser.add_argument("--prompt-len", type=int, default=10)
    parser.add_argument("--latency-steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8,
                        help="timed generate calls per cache (>= 1); 8 x 128 steps puts ~10 samples in the slowest 1%%, "
                             "where 2-3 repeats left P99 to 2-4 samples and it swung by 1.5x between runs")
    parser.add_argument("--gc", choices=hf_latency.GC_MODES, default="on",
                        help="Python GC while timing: on, freeze (gc.freeze() after loading, as servers do), or off "
                             "(disabled during the timed calls); to test whether GC makes the P99 tail")
    parser.add_argument("--gc-freeze", action="store_true", help="the same as --gc freeze")
    parser.add_argument("--no-static", action="store_true", help="leave StaticCache out of the latency part")
    parser.add_argument("--no-diagnose", action="store_true",
                        help="skip the profiler and sync-debug runs (GPU busy time, syncs per step)")
    parser.add_argument("--sharing-batches", default="1,8")
    parser.add_argument("--sharing-prompt-len", type=int, default=512)
    parser.add_argument("--sharing-new-tokens", type=int, default=128)
    add_out_argument(parser, "the hf*.json, .md and .png results")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.only != "sharing" and not device.startswith("cuda"):
        why = "torch.cuda.is_available() is False" if args.device is None else f"--device is {device}"
        raise GPURequiredError(f"pagedkv bench hf needs a CUDA GPU, and {why}; on CPU: --only sharing")
    if args.only == "latency":
        latency, lines = _latency_report(args)
        write_json(args.out, "hf_latency", {"benchmark": "hf_latency",
                                            "provenance": provenance(torch.cuda.get_device_name()), **latency})
        prov = provenance(torch.cuda.get_device_name())
        Path(args.out, "hf_latency.md").write_text("\n".join(
            [f"# HF decode latency ({prov['device']}, {prov['date']}, commit {prov['commit']})", "", *lines]) + "\n")
        print(f"wrote hf_latency.json and .md in {args.out}")
        return 0
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.float16 if device.startswith("cuda") else torch.float32)
    if args.quick:
        model = random_model("gpt2", dtype, device, n_layer=2, n_embd=128, n_head=4)
        label = "random GPT-2 shape (2 layers x 128 wide)"
    else:
        model = load_model(args.model, dtype, device)
        label = "random GPT-2 124M" if args.model == "random:gpt2" else args.model
    _sharing_report(model, label, args)
    if args.only == "sharing":
        return 0
    console = Console()
    num_blocks = args.batch * args.budget // 16 * 2
    pool = PagePool.for_model(model, num_blocks=num_blocks, block_size=16)
    naive_bytes = args.batch * args.budget * pool.bytes_per_token

    memory = _memory(model, pool, args.batch, args.prompt_len, args.budget)
    curve1, ids1 = _curve(model, pool, 8, args.prompt_len, 120, seed=5)
    curve2, ids2 = _curve(model, pool, 8, args.prompt_len, 120, seed=6)
    lifecycle = {"batch1_blocks": curve1, "batch2_blocks": curve2, "same_block_ids": ids1 == ids2,
                 "pool_used_after": pool.num_used_blocks}
    result = {"benchmark": "hf", "model": f"{label} {str(model.dtype).removeprefix('torch.')}",
              "provenance": provenance(torch.cuda.get_device_name()), "sharing": "hf_sharing.json",
              "batch": args.batch, "budget_tokens": args.budget, "prompt_len": args.prompt_len, "block_size": 16,
              "bytes_per_token": pool.bytes_per_token, "memory": memory, "lifecycle": lifecycle}
    result["plots"] = _plots(args.out, memory, curve1, curve2, pool.kv.bytes_per_block, naive_bytes, pool,
                             args.batch, args.prompt_len, args.budget)
    del model, pool
    torch.cuda.empty_cache()

    table = Table(title="KV memory (MB), GPT-2 124M fp16, 32 sequences, 512-token budget, page 16")
    for column in ("step", "naive", "DynamicCache", "StaticCache", "PagedCache (blocks)", "PagedCache peak delta",
                   "naive / paged"):
        table.add_column(column, justify="right")
    for step, row in memory.items():
        table.add_row(step, f"{row['naive_bytes'] / 1e6:.2f}", f"{row['dynamic_bytes'] / 1e6:.2f}",
                      f"{row['static_bytes'] / 1e6:.2f}", f"{row['paged_bytes'] / 1e6:.2f}",
                      f"{row['paged_peak_delta_bytes'] / 1e6:.2f}", f"{row['naive_bytes'] / row['paged_bytes']:.1f}x")
    console.print(table)
    latency, latency_lines = _latency_report(args)
    result["latency"] = latency
    step50 = memory["50"]
    targets = {
        "paged_p50_p99_le_dynamic": all(goal["met"] for batches in latency["targets"].values()
                                        for goal in batches.values()),
        "paged_8x_less_than_naive_at_step_50": step50["naive_bytes"] / step50["paged_bytes"] >= 8.0,
    }
    result["targets"] = targets
    console.print(f"targets: {targets}; lifecycle: batch 2 reused batch 1's block ids = {lifecycle['same_block_ids']}, "
                  f"pool used after = {lifecycle['pool_used_after']}")
    write_json(args.out, "hf", result)
    md = [f"# HF cache benchmark ({result['provenance']['device']}, {result['provenance']['date']}, commit "
          f"{result['provenance']['commit']})", "", "| step | naive MB | DynamicCache MB | StaticCache MB | "
          "PagedCache MB | PagedCache peak delta MB | naive/paged |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for step, row in memory.items():
        md.append(f"| {step} | {row['naive_bytes'] / 1e6:.2f} | {row['dynamic_bytes'] / 1e6:.2f} | "
                  f"{row['static_bytes'] / 1e6:.2f} | {row['paged_bytes'] / 1e6:.2f} | "
                  f"{row['paged_peak_delta_bytes'] / 1e6:.2f} | {row['naive_bytes'] / row['paged_bytes']:.1f}x |")
    md += ["", *latency_lines, "", f"Targets: {targets}"]
    Path(args.out, "hf.md").write_text("\n".join(md) + "\n")
    print(f"wrote hf.json, hf.md and the plots in {args.out}")
    return 0
