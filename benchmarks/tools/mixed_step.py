"""Mixed-step cost with full and piecewise CUDA graphs, decode graphs only, and eager, same machine, same run.

Qwen3-0.6B shape, bf16, random weights. For each mode (its own engine, one after the other):
- the mixed step: 64 running decodes plus a 512-token prompt arriving every step; its median
  wall time (the engine's step timing, no profiler) and its GPU time (the kernels' summed device
  time under torch.profiler over a separate set of the same steps), and their ratio;
- a prefill-only step: one 2,048-token prompt on an idle engine (TTFT in the engine, median of 5);
- the 512-token prefill alone (no decodes);
- attention alone for mixed steps whose decode rows are long: the unified kernel (what a full graph
  runs; it splits no row's KV) against split-KV decode + prefill (what eager and piecewise steps run).
Prints a table and writes OUT_DIR/mixed_step.json. Usage: python benchmarks/tools/mixed_step.py OUT_DIR
"""

import json
import os
import statistics
import sys
import time

import torch

from pagedkv import LLM, SamplingParams

MODES = {"full": {}, "piecewise": {"mixed_step_graphs": "piecewise"}, "decode_graphs_only": {"mixed_step_graphs": "off"},
         "eager": {"enforce_eager": True}}


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + j * 31) % 150000 + 3 for j in range(n)]


def device_ms_per_step(engine, make_step, num_steps: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(num_steps):
            make_step(k)
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e3 / num_steps


def measure(mode: str, options: dict) -> dict:
    llm = LLM("random:qwen3-0.6b", dtype="bfloat16", max_model_len=4096, max_num_seqs=128,
              max_num_batched_tokens=2048, kv_cache_memory=0.3, **options)
    engine = llm.engine
    engine.stream_outputs = False
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    result = {"mode": mode}
    # Idle prefill: one 2,048-token prompt, and one 512-token prompt (each its own step).
    for n in (2048, 512):
        times = []
        for rep in range(6):
            start = time.perf_counter()
            llm.generate([prompt(n, 1000 + rep + n)], one, use_tqdm=False)
            times.append(time.perf_counter() - start)
        result[f"prefill_{n}_ms"] = statistics.median(times[1:]) * 1e3
    # Mixed: 64 running decodes, a 512-token prompt arriving every step.
    decode = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"d{i}", prompt(32, i), decode)
    for _ in range(4):
        engine.step()
    counter = iter(range(10**6))

    def mixed_step(_k):
        engine.add_request(f"p{next(counter)}", prompt(512, 5000 + next(counter)), one)
        engine.step()

    for k in range(8):  # warm-up (kernel compiles at these shapes)
        mixed_step(k)
    engine.step_timings = []
    for k in range(40):
        mixed_step(k)
    steps = [t for t in engine.step_timings if t.shape.prefill_tokens == 512 and t.shape.decode_seqs == 64]
    result["mixed_steps_timed"] = len(steps)
    result["mixed_step_ms"] = statistics.median(t.total_s for t in steps) * 1e3
    result["mixed_launch_ms"] = statistics.median(t.launch_s for t in steps) * 1e3
    engine.step_timings = None
    result["mixed_gpu_ms"] = device_ms_per_step(engine, mixed_step, 10)
    result["mixed_step_over_gpu"] = result["mixed_step_ms"] / result["mixed_gpu_ms"]
    for i in range(64):
        engine.abort(f"d{i}")
    while engine.has_unfinished_requests():
        engine.step()
    del llm, engine
    torch.cuda.empty_cache()
    return result


def long_decode_kernels() -> list[dict]:
    """Attention alone for a mixed step of D decode rows of length L plus a 512-token chunk (Qwen3-0.6B heads):
    the unified kernel (what a full graph runs) against split-KV decode + prefill (two launches), graphed."""
    from pagedkv.bench.kernel_common import _graphed, _time_ms, make_paged
    from pagedkv.kernels import paged_attention, paged_decode_attention, paged_prefill_attention

    device = torch.device("cuda")
    rows = []
    for num_decode, seq_len in ((64, 512), (64, 4096), (8, 8192), (8, 16384), (1, 32768)):
        chunk = 512
        _, k_cache, v_cache, tables, lens = make_paged(num_decode + 1, seq_len, 16, True, device, torch.bfloat16,
                                                       heads=(16, 8, 128))
        num_tokens = num_decode + chunk
        q = torch.randn(num_tokens, 16, 128, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        q_lens = [1] * num_decode + [chunk]
        cu_all = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        cu_prefill = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        scale = 128 ** -0.5

        def unified():
            paged_attention(q, k_cache, v_cache, tables, lens, cu_all, scale=scale, max_seqlen_q=chunk, out=out,
                            validate=False)

        def split():
            paged_decode_attention(q[:num_decode], k_cache, v_cache, tables[:num_decode], lens[:num_decode],
                                   scale=scale, max_seq_len=seq_len, out=out[:num_decode], validate=False)
            paged_prefill_attention(q[num_decode:], k_cache, v_cache, tables[num_decode:], lens[num_decode:],
                                    cu_prefill, scale=scale, max_seqlen_q=chunk, max_seq_len=seq_len,
                                    out=out[num_decode:], validate=False)

        row = {"decode_rows": num_decode, "decode_len": seq_len, "chunk": chunk,
               "unified_ms": _time_ms(_graphed(unified), device), "split_ms": _time_ms(_graphed(split), device)}
        row["unified_over_split"] = row["unified_ms"] / row["split_ms"]
        rows.append(row)
        print(f"attention only, {num_decode} decode rows x {seq_len} + a {chunk}-token chunk: unified "
              f"{row['unified_ms'] * 1e3:.0f} us, decode + prefill {row['split_ms'] * 1e3:.0f} us "
              f"({row['unified_over_split']:.2f}x)")
        del k_cache, v_cache
    return rows


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # capture time and memory
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    rows = [measure(mode, options) for mode, options in MODES.items()]
    commit = os.environ.get("PAGEDKV_COMMIT", "unknown")
    report = {"benchmark": "mixed_step", "gpu": torch.cuda.get_device_name(), "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "model": "random:qwen3-0.6b (bf16)",
              "target": "mixed step (64 decodes + a 512-token chunk) <= 1.2x its GPU time", "modes": rows,
              "attention_long_decode": long_decode_kernels()}
    print(f"{'mode':<20} {'mixed ms':>9} {'GPU ms':>8} {'ratio':>6} {'launch ms':>10} {'prefill2048 ms':>15} "
          f"{'prefill512 ms':>14}")
    for r in rows:
        print(f"{r['mode']:<20} {r['mixed_step_ms']:9.2f} {r['mixed_gpu_ms']:8.2f} {r['mixed_step_over_gpu']:6.2f} "
              f"{r['mixed_launch_ms']:10.2f} {r['prefill_2048_ms']:15.2f} {r['prefill_512_ms']:14.2f}")
    with open(os.path.join(out_dir, "mixed_step.json"), "w") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
