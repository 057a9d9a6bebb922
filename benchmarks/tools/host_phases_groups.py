"""The host phases of a decode step at batch 64 on Gemma-3-1B's layer layout, against one layer group (CPU).

The schedule and build phases of a step depend on the number of sequences and of layer
groups, not on the model's width, so a 26-layer Gemma 3 of tiny width on a CPU shows the host
time the H200 step pays (`bench latency` there: schedule 2.76 ms, build 0.96 ms of a 5.37 ms
step at batch 64). The same model with every layer full attention (one group) is the baseline.

    PYTHONPATH=src python benchmarks/tools/host_phases_groups.py --out /tmp/out   # about 4 minutes on 2 cores

Writes host_phases_groups.json: per layout, the median of each host phase over the decode
steps at batch 64 (ms). Benchmarks never assert.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from pagedkv import LLM, SamplingParams
from pagedkv.results import provenance

NUM_LAYERS, SLIDING_PER_FULL, WINDOW, BATCH = 26, 5, 512, 64
PHASES = ("schedule_s", "build_s", "update_s")


def tiny_gemma3(all_full: bool):
    types = ["full_attention" if all_full or (i + 1) % (SLIDING_PER_FULL + 1) == 0 else "sliding_attention"
             for i in range(NUM_LAYERS)]
    config = Gemma3TextConfig(num_hidden_layers=NUM_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                              hidden_size=32, intermediate_size=32, head_dim=16, vocab_size=512,
                              max_position_embeddings=4096, sliding_window=WINDOW, query_pre_attn_scalar=16,
                              layer_types=types, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def host_phases(all_full: bool) -> dict:
    llm = LLM(hf_model=tiny_gemma3(all_full), device="cpu", kv_cache_memory=512 * 2**20, max_model_len=1024,
              max_num_seqs=BATCH, max_num_batched_tokens=8192, hybrid_kv=True)
    engine = llm.engine
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(str(i), torch.randint(3, 500, (128,), generator=gen).tolist(), params)
    engine.step_timings = []
    while engine.has_unfinished_requests():
        engine.step()
    steps = [t for t in engine.step_timings if t.shape.prefill_tokens == 0 and t.shape.decode_seqs == BATCH]
    layout = getattr(engine.scheduler.block_manager, "layout", None)
    return {"num_groups": layout.num_groups if layout is not None else 1, "num_steps": len(steps),
            **{name.replace("_s", "_ms"): statistics.median(getattr(t, name) for t in steps) * 1e3
               for name in PHASES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = {"one group (every layer full)": host_phases(True), "Gemma-3-1B layout": host_phases(False)}
    for name, row in rows.items():
        print(f"{name}: {row['num_groups']} groups, schedule {row['schedule_ms']:.2f} ms, build "
              f"{row['build_ms']:.2f} ms, update {row['update_ms']:.2f} ms (median of {row['num_steps']} steps)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_phases_groups.json").write_text(json.dumps(
        {"benchmark": "host_phases_groups", "provenance": provenance(), "batch": BATCH, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
