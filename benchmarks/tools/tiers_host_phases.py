"""Host time per step phase on the chat-tiers workload with the device taken out: what the KV tiers add.

    PYTHONPATH=src python3 benchmarks/tools/tiers_host_phases.py [--profile] [--out DIR]   (CPU, ~1 min)

The chat-tiers bench's Qwen3-0.6B workload (`bench engine --preset chat-tiers`: 128 conversations x 3 turns over
64 system prompts of 1,024 tokens, 4 turns in flight, a GPU pool of 563 blocks, ~8,900 host blocks) runs
through a real engine on a tiny Qwen3 model whose runner is stubbed: each step's block moves still run (on the
CPU, synchronously, over tiny blocks), but no forward pass; a token per sampling row comes back at once. So
the step phases (`LLMEngine.step_timings`) measure the Python the engine runs per step, the same in every
configuration but for what the tiers add: GPU-only prefix caching against the host tier (no disk tier:
its writer threads would compete for this machine's cores). On an H200 host the same Python runs faster; the
difference between the configurations is what to read. `--profile` adds a cProfile of the tiered run
(pagedkv's functions by own time). Prints a markdown table, writes tiers_host_phases.json; asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path

import torch

from host_overhead import InstantResult  # benchmarks/tools, this script's folder
from pagedkv import LLM
from pagedkv.bench.chat_tiers_run import run_chat
from pagedkv.engine.outputs import STEP_PHASES
from pagedkv.models.loader import random_model
from pagedkv.sim.chat_tiers import MultiTurnChat

#: The bench's Qwen3-0.6B pool (563 blocks of 16 tokens) and host tier (16 GiB of 1.84 MB blocks).
NUM_BLOCKS = 563
NUM_HOST_BLOCKS = 16 * 2**30 // (1835008)


def stub_device(engine) -> None:
    """The runner's forward pass replaced by `InstantResult`; the step's block moves and disk reads still run."""
    runner = engine.runner

    def execute(step, previous_tokens=None):
        if runner.offload is not None:
            runner.offload.move(step)
            runner.offload.finish_loads(wait=True)
        return InstantResult(len(step.sample_seqs)) if step.sample_seqs else None

    runner.execute = execute


def tiny_model():
    """A tiny Qwen3 (random weights) that takes the workload's 1,500-token conversations."""
    model = random_model("tiny-qwen3", torch.float32, "cpu")
    model.config.max_position_embeddings = 2048
    return model


def run(label: str, options: dict, turns: list, profile: bool) -> dict:
    llm = LLM(hf_model=tiny_model(), device="cpu", block_size=16, num_blocks=NUM_BLOCKS, max_num_seqs=4,
              max_model_len=2048, max_num_batched_tokens=4096, **options)
    stub_device(llm.engine)
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    result = run_chat(llm.engine, turns, 4, 1024, freeze_heap=True)
    if profiler is not None:
        profiler.disable()
    stats = llm.stats()
    steps = result["steps"]
    row = {"config": label, "num_steps": steps["num_steps"], "elapsed_s": result["elapsed_s"],
           "host_hit_blocks": stats.get("kv_host_hit_blocks", 0),
           "offloaded_blocks": stats.get("kv_offloaded_blocks", 0),
           **{name: steps[name] for name in STEP_PHASES}}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats("pagedkv", 30)
        row["profile"] = text.getvalue()
    llm.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="cProfile the tiered run")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    workload = MultiTurnChat(num_system_prompts=64, num_conversations=128, num_turns=3, num_concurrent=128,
                             system_prompt_tokens=1024, min_user_tokens=32, max_user_tokens=128,
                             min_output_tokens=8, max_output_tokens=24, vocab_size=500)
    turns = workload.fixed_turns()
    probe = LLM(hf_model=tiny_model(), device="cpu", block_size=16, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                max_model_len=2048)
    host_bytes = NUM_HOST_BLOCKS * probe.engine.pool.bytes_per_block
    probe.shutdown()
    del probe
    rows = [run("GPU only", {}, turns, False),
            run("GPU + host", dict(kv_offload_memory=host_bytes), turns, args.profile)]
    phases = [name[:-2] for name in STEP_PHASES]
    lines = ["| config | steps | " + " | ".join(f"{p} s" for p in phases) + " | host hits | spilled |",
             "|---|---:|" + "---:|" * (len(phases) + 2)]
    for row in rows:
        lines.append(f"| {row['config']} | {row['num_steps']} | " + " | ".join(f"{row[p + '_s']:.3f}" for p in phases)
                     + f" | {row['host_hit_blocks']} | {row['offloaded_blocks']} |")
    text = "\n".join(lines)
    print(text)
    if args.profile:
        print(rows[1]["profile"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiers_host_phases.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
