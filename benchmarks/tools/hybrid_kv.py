"""KV bytes per sequence at a long context with layer groups against every layer full length, from the engine.

    PYTHONPATH=src python3 benchmarks/tools/hybrid_kv.py --out DIR [--model random:gemma3-12b] [--context 32768]
        [--pool-gib 24] [--num-seqs 4] [--device cuda]
    CPU smoke: --model random:tiny-gemma3 --context 96 --pool-gib 0.001 --num-seqs 3 --device cpu --block-size 4

One random-weight model, two engines over the same pool budget: `hybrid_kv=True` (a table per
layer group; sliding groups keep only their window) and `hybrid_kv=False` (one full-length table
for every layer). Each generates `--num-seqs` sequences of `--context` tokens (prompt + a few
decode steps). Every step records the blocks each sequence holds; the figures are read from the
engine's own allocation: the pool tensor's bytes, its blocks, and the blocks held per running
sequence while it decodes (the most any one held). Prints a table, writes hybrid_kv.json and hybrid_kv.md; asserts
nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.calc.capacity import format_bytes
from pagedkv.hf import random_model
from pagedkv.results import provenance

GIB = 2**30


def measure(model, args, hybrid: bool) -> dict:
    """One engine over the pool budget: its allocation, and what the sequences held while decoding."""
    llm = LLM(hf_model=model, block_size=args.block_size, kv_cache_memory=int(args.pool_gib * GIB),
              max_model_len=args.context + 8, max_num_batched_tokens=args.chunk, max_num_seqs=args.num_seqs,
              hybrid_kv=hybrid, enforce_eager=args.eager, device=args.device)
    engine = llm.engine
    bm = engine.scheduler.block_manager
    pool = engine.pool
    page_bytes = pool.bytes_per_block
    samples = []

    def held_blocks(seq_id: int) -> int:
        if bm.num_groups == 1:
            return bm.group_table(seq_id, 0).num_blocks
        return sum(bm.num_held_blocks(seq_id, g) for g in range(bm.num_groups))

    def on_step(out, seconds):
        live = [item.seq.seq_id for item in out.scheduled if bm.has_table(item.seq.seq_id)]
        decoding = all(item.num_new_tokens == 1 for item in out.scheduled)
        samples.append({"num_running": len(out.scheduled), "decode": decoding, "used_blocks": bm.num_used_blocks,
                        "max_seq_blocks": max((held_blocks(s) for s in live), default=0), "seconds": seconds})

    engine.on_step = on_step
    gen = torch.Generator().manual_seed(0)
    prompt_len = args.context - args.decode_tokens
    vocab = min(30000, model.config.get_text_config().vocab_size)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(args.num_seqs)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True))
    wall_s = time.perf_counter() - started
    decode_blocks = [s["max_seq_blocks"] for s in samples if s["decode"]]
    # The blocks one max-context sequence holds at its peak, as the scheduler admits it.
    peak_blocks = engine.scheduler.config.blocks_for_request(args.context)
    return {
        "hybrid_kv": hybrid,
        "num_groups": getattr(bm, "num_groups", 1),
        "page_bytes": page_bytes,
        "num_blocks": bm.num_blocks,
        "pool_bytes": pool.kv.numel() * pool.kv.element_size(),
        "max_concurrent_seqs": max((s["num_running"] for s in samples), default=0),
        "seq_bytes_decoding": max(decode_blocks) * page_bytes if decode_blocks else None,  # the most one seq held
        "seq_peak_bytes_as_admitted": peak_blocks * page_bytes,
        "seqs_in_pool_as_admitted": bm.num_blocks // peak_blocks,
        "peak_used_blocks": bm.allocator.peak_used,
        "num_finished": sum(o.finished for o in outputs),
        "num_preemptions": engine.scheduler.stats.num_preemptions,
        "wall_s": wall_s,
        "num_steps": len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="random:gemma3-12b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--pool-gib", type=float, default=24.0)
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the engine's default)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    model = random_model(args.model.removeprefix("random:"), getattr(torch, args.dtype), device)
    load_s = time.perf_counter() - started
    rows = []
    for hybrid in (True, False):
        rows.append(measure(model, args, hybrid))
        gc.collect()  # the first engine's pool (and decoder copy) goes before the second is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    grouped, full = rows
    ratio = full["seq_bytes_decoding"] / grouped["seq_bytes_decoding"] \
        if grouped["seq_bytes_decoding"] and full["seq_bytes_decoding"] else None
    result = {"model": args.model, "context": args.context, "pool_gib": args.pool_gib, "block_size": args.block_size,
              "load_s": load_s, "rows": rows, "bytes_per_seq_ratio": ratio,
              "admitted_concurrency_ratio": grouped["seqs_in_pool_as_admitted"] / max(1, full["seqs_in_pool_as_admitted"]),
              "provenance": provenance("measured (engine allocation)")}
    lines = [f"# KV per sequence at {args.context:,} tokens: {args.model}, pool {args.pool_gib:g} GiB, "
             f"block {args.block_size}",
             "", "| tables | groups | page | blocks in pool | pool bytes | KV per seq (decoding, measured) | "
             "KV per seq (peak, as admitted) | seqs the pool admits | seqs run at once | preemptions | wall |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        name = "per layer group" if row["hybrid_kv"] else "every layer full length"
        per_seq = row["seq_bytes_decoding"]
        lines.append(f"| {name} | {row['num_groups']} | {format_bytes(row['page_bytes'])} | {row['num_blocks']:,} | "
                     f"{format_bytes(row['pool_bytes'])} | {'-' if per_seq is None else format_bytes(per_seq)} | "
                     f"{format_bytes(row['seq_peak_bytes_as_admitted'])} | {row['seqs_in_pool_as_admitted']} | "
                     f"{row['max_concurrent_seqs']} | {row['num_preemptions']} | {row['wall_s']:.1f} s |")
    lines += ["", f"KV per sequence, full length / per group: {ratio:.2f}x" if ratio else "",
              f"sequences the pool admits at {args.context:,} tokens, per group / full length: "
              f"{result['admitted_concurrency_ratio']:.2f}x"]
    text = "\n".join(lines)
    print(text)
    (out / "hybrid_kv.md").write_text(text + "\n")
    (out / "hybrid_kv.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
