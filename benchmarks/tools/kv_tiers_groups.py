"""KV tiers on a model with layer groups: prompts that spill out of a small GPU pool, restored per group, and a restart.

    PYTHONPATH=src python3 benchmarks/tools/kv_tiers_groups.py --out DIR [--model gemma3-1b] [--prompts 16]
        [--prompt-tokens 2048] [--device cuda]
    CPU smoke: --model tiny-gemma3 --prompts 4 --prompt-tokens 40 --question-tokens 6 --block-size 4 --device cpu
        --dtype float32 --host-bytes 1048576

`--prompts` long system prompts, each followed by a fresh question (64 tokens), through a GPU pool that holds
the blocks of about two of them. Each configuration serves every prompt twice, one request at a time: a cold
pass (the tiers spill what the pool evicts), then a warm pass with new questions, timed (TTFT). Then the
tiers' engine shuts down (writing its cache to disk), a new engine opens the same directory and serves a
third pass: what came from disk. Per pass: TTFT P50, where the blocks of a hit came from (GPU, host, disk),
over the blocks a full hit takes (every full-attention group's prefix, each sliding group's window), and
the bytes restored per prompt against what the same restore would move if every layer kept every token.
Prints a table, writes kv_tiers_groups.json; asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.hf import random_model
from pagedkv.results import provenance, write_json
from pagedkv.sim.cluster import percentile

HIT_FIELDS = {"gpu": "kv_gpu_hit_blocks", "host": "kv_host_hit_blocks", "disk": "kv_disk_hit_blocks"}


def full_hit_blocks(layout, shared_tokens: int, block_size: int) -> int:
    """Blocks of every group a hit on the shared prefix's full blocks takes (a sliding group: its window)."""
    num_hit = shared_tokens // block_size
    return sum(num_hit - group.first_live_block(num_hit * block_size, block_size) for group in layout.groups)


def serve_pass(llm, prompts: list[list[int]], shared_tokens: int, layout, block_size: int) -> dict:
    """Every prompt alone (max_tokens=1): TTFT, and the run's hits per tier over the shared prefixes' blocks, the
    share of their tokens served from a cache, and the bytes restored."""
    before = llm.stats()
    ttfts = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        ttfts.append(time.perf_counter() - start)
    after = llm.stats()
    delta = {key: after.get(key, 0) - before.get(key, 0)
             for key in (*HIT_FIELDS.values(), "kv_h2d_bytes", "prefix_cache_hit_tokens")}
    full = len(prompts) * full_hit_blocks(layout, shared_tokens, block_size)
    hit_tokens = len(prompts) * (shared_tokens // block_size * block_size)
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_s": ttfts,
            "full_hit_blocks": full, "cached_token_share": delta["prefix_cache_hit_tokens"] / hit_tokens, **{f"{tier}_share": delta[field] / full if full else 0.0 for tier, field in HIT_FIELDS.items()},
            "restored_bytes_per_prompt": delta["kv_h2d_bytes"] / len(prompts),
            # the same hits, every layer keeping every token: the full-length table's bytes per prompt
            "full_length_bytes_per_prompt": layout.full_length_seq_kv_bytes(hit_tokens // len(prompts), block_size)}


def run(args) -> dict:
    """The configurations and the restart; prints a row per pass."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = random_model(args.model, dtype, device)
    vocab = min(model.config.get_text_config().vocab_size, 32000)
    generator = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    systems = [fresh(args.prompt_tokens) for _ in range(args.prompts)]
    passes = [[s + fresh(args.question_tokens) for s in systems] for _ in range(3)]
    common = dict(hf_model=model, block_size=args.block_size, max_num_seqs=4, mixed_step_graphs="off",
                  max_model_len=args.prompt_tokens + args.question_tokens + 8, enforce_eager=args.device == "cpu")
    probe = LLM(num_blocks=4096, **common)  # only for its layer layout
    layout = probe.engine.scheduler.block_manager.layout
    del probe
    # About two prompts' cached blocks: every block each group computed stays cached (sliding ones too).
    num_blocks = 2 * layout.num_groups * (args.prompt_tokens // args.block_size + 8)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="kv-tiers-groups-"))
    tiers = dict(kv_offload_memory=args.host_bytes, kv_offload_dir=str(directory),
                 kv_offload_disk_bytes=4 * args.host_bytes)
    result = {"model": args.model, "dtype": args.dtype, "block_size": args.block_size, "num_blocks": num_blocks,
              "groups": [(g.attention_type, g.sliding_window, len(g.layer_indices)) for g in layout.groups],
              "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "configs": {},
              "provenance": provenance(torch.cuda.get_device_name() if device.type == "cuda" else "cpu")}
    for label, options in (("GPU only", {}), ("GPU + host + disk", tiers)):
        llm = LLM(num_blocks=num_blocks, **common, **options)
        rows = {"cold": serve_pass(llm, passes[0], args.prompt_tokens, layout, args.block_size),
                "warm": serve_pass(llm, passes[1], args.prompt_tokens, layout, args.block_size)}
        llm.shutdown()  # the tiers' engine writes its cache to disk
        if options:
            restarted = LLM(num_blocks=num_blocks, **common, **options)
            rows["restart"] = serve_pass(restarted, passes[2], args.prompt_tokens, layout, args.block_size)
            restarted.shutdown()
        result["configs"][label] = rows
        for name, row in rows.items():
            print(f"{args.model} | {label} | {name}: TTFT P50 {row['ttft_p50_s'] * 1e3:.1f} ms; prefix tokens "
                  f"cached {row['cached_token_share'] * 100:.0f}%; hit blocks from GPU "
                  f"{row['gpu_share'] * 100:.0f}% host {row['host_share'] * 100:.0f}% disk "
                  f"{row['disk_share'] * 100:.0f}%; restored {row['restored_bytes_per_prompt'] / 2**20:.2f} MiB "
                  f"per prompt (every layer full length: {row['full_length_bytes_per_prompt'] / 2**20:.2f} MiB)",
                  flush=True)
    if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="gemma3-1b", help="a random-weight shape (pagedkv.models.shapes)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--host-bytes", type=int, default=2 * 2**30)
    parser.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh one, removed)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    write_json(args.out, "kv_tiers_groups", run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
