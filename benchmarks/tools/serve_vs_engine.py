"""The offline side of serve_vs_engine.sh, and its summary: the engine on the requests the server gets.

    PYTHONPATH=src python3 benchmarks/tools/serve_vs_engine.py engine --out DIR [--model random:qwen3-0.6b ...]
    PYTHONPATH=src python3 benchmarks/tools/serve_vs_engine.py report --out DIR

`engine` builds the engine as `pagedkv serve` does (same EngineConfig fields), writes nano-vllm's
workload as token-id files for `bench serve --dataset ids` (requests.json with seed S for the
headline run; requests_s1..3.json with seeds S+1..S+3 for the diagnostic runs, so no run finds
another's prompts in the prefix cache; requests_warm.json and requests_single.json, six
128-token prompts for 256 tokens), and times on them:

- `offline`: `LLM.generate` on requests.json (outputs reported only when finished, as offline);
- `offline_streaming`: requests_s1.json stepped by hand with `stream_outputs` on, every step reporting
  every request as the server's engine thread does: the engine's own share of streaming;
- `batch1`: one request (128-token prompt, 256 new tokens), stepped by hand, timestamping each
  token as a client would: TTFT, TPOT, and the median batch-1 decode step.

`report` reads engine.json, the bench serve runs and serve_profiled.py's windows, prints one
table and writes summary.json and summary.md. Benchmarks never assert: missing parts read n/a.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_requests(path: Path, prompts, output_lens) -> None:
    path.write_text(json.dumps([{"prompt_token_ids": p, "max_tokens": n} for p, n in zip(prompts, output_lens)]))


def _step_summary(steps: list[tuple], timings: list) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_profiled import step_summary

    return step_summary(steps, timings)


def _recording(engine):
    """Turn on per-step shape and phase recording; returns (steps, timings) lists that fill as it steps."""
    steps, timings = [], []
    engine.step_timings = timings
    engine.on_step = lambda out, seconds: steps.append(
        (out.shape.prefill_tokens, out.shape.decode_seqs, out.shape.kv_tokens, seconds))
    return steps, timings


def _stop_recording(engine) -> None:
    engine.step_timings, engine.on_step = None, None


def run_offline(llm, prompts, output_lens) -> dict:
    """One `generate` over every request, as `bench engine` times it; tokens over wall time, and its steps."""
    from pagedkv.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    steps, timings = _recording(engine)
    _sync(engine.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    _stop_recording(engine)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "num_output_tokens": generated, "output_tokens_per_s": generated / elapsed,
            "steps": _step_summary(steps, timings)}


def run_streaming(engine, prompts, output_lens, prefix: str) -> dict:
    """Every request added at once, then `engine.step()` until done with `stream_outputs` on.

    Returns tokens over wall time, the outputs the steps returned, and per-request token times
    (TTFT and TPOT as a client that reads each step's outputs would see them).
    """
    from pagedkv.engine.sampling_params import SamplingParams

    streaming, engine.stream_outputs = engine.stream_outputs, True
    steps, timings = _recording(engine)
    first, last, counts = {}, {}, {}
    num_outputs = 0
    try:
        _sync(engine.device)
        start = time.perf_counter()
        for index, (prompt, n) in enumerate(zip(prompts, output_lens)):
            engine.add_request(f"{prefix}-{index}", prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                           ignore_eos=True))
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            num_outputs += len(outputs)
            for output in outputs:
                num_tokens = len(output.outputs[0].token_ids) if output.outputs else 0
                if num_tokens and output.request_id not in first:
                    first[output.request_id] = now
                if num_tokens:
                    last[output.request_id] = now
                    counts[output.request_id] = num_tokens
        _sync(engine.device)
        elapsed = time.perf_counter() - start
    finally:
        engine.stream_outputs = streaming
        _stop_recording(engine)
    generated = sum(counts.values())
    ttft = [first[r] - start for r in first]
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return {"elapsed_s": elapsed, "num_output_tokens": generated, "output_tokens_per_s": generated / elapsed,
            "num_outputs": num_outputs, "ttft_ms_p50": 1000 * statistics.median(ttft) if ttft else None,
            "tpot_ms_p50": 1000 * statistics.median(tpot) if tpot else None, "steps": _step_summary(steps, timings),
            "_step_seconds": [s[3] for s in steps if s[1] == 1 and s[0] == 0]}


def engine_main(args: argparse.Namespace) -> int:
    from pagedkv.bench.engine import nano_vllm_workload
    from pagedkv.cli import parse_memory
    from pagedkv.engine.llm import LLM
    from pagedkv.results import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_memory=parse_memory(args.kv_cache_memory),
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    startup_s = time.perf_counter() - start
    vocab = engine.vocab_size
    workloads = {}
    for name, seed in (("requests.json", args.seed), ("requests_s1.json", args.seed + 1),
                       ("requests_s2.json", args.seed + 2), ("requests_s3.json", args.seed + 3)):
        workloads[name] = nano_vllm_workload(args.num_requests, args.min_len, args.max_len, seed, vocab)
        _write_requests(out / name, *workloads[name])
    warm_len = max(2, min(64, args.max_len // 2))
    warm_prompts, warm_lens = nano_vllm_workload(8, max(1, warm_len // 2), warm_len, 10_000 + args.seed, vocab)
    _write_requests(out / "requests_warm.json", *nano_vllm_workload(8, max(1, warm_len // 2), warm_len,
                                                                    20_000 + args.seed, vocab))
    rng = random.Random(args.seed + 30_000)
    single = [[rng.randrange(0, min(vocab, 10_000)) for _ in range(args.single_input_len)] for _ in range(6)]
    _write_requests(out / "requests_single.json", single, [args.single_output_len] * len(single))
    print(f"engine up in {startup_s:.1f} s ({engine.device}, vocab {vocab}); wrote {', '.join(workloads)}, "
          f"requests_warm.json, requests_single.json", flush=True)

    run_offline(llm, warm_prompts, warm_lens)
    import torch

    device_name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    result = {"benchmark": "serve_vs_engine.engine", "provenance": provenance(device_name), "model": args.model,
              "config": {k: v for k, v in vars(args).items() if k != "func"}, "startup_s": startup_s,
              "num_blocks": engine.scheduler.block_manager.num_blocks, "max_model_len": engine.max_model_len}
    result["offline"] = run_offline(llm, *workloads["requests.json"])
    print(f"offline: {result['offline']['output_tokens_per_s']:,.0f} output tok/s "
          f"({result['offline']['elapsed_s']:.1f} s)", flush=True)
    if args.random_num_requests:  # fixed lengths (random 1,024 in / 256 out), the same file the server gets
        rng = random.Random(args.seed + 40_000)
        prompts = [[rng.randrange(0, min(vocab, 10_000)) for _ in range(args.random_input_len)]
                   for _ in range(args.random_num_requests)]
        lens = [args.random_output_len] * args.random_num_requests
        _write_requests(out / "requests_random.json", prompts, lens)
        result["offline_random"] = run_offline(llm, prompts, lens)
        print(f"offline random {args.random_input_len}/{args.random_output_len}: "
              f"{result['offline_random']['output_tokens_per_s']:,.0f} output tok/s", flush=True)
    if not args.skip_streaming:
        result["offline_streaming"] = run_streaming(engine, *workloads["requests_s1.json"], prefix="stream")
        result["offline_streaming"].pop("_step_seconds")
        print(f"offline, stream_outputs on: {result['offline_streaming']['output_tokens_per_s']:,.0f} output tok/s",
              flush=True)

    rng = random.Random(args.seed + 3)
    batch1 = []
    for repeat in range(3):
        prompt = [rng.randrange(100, min(vocab, 10_000)) for _ in range(args.single_input_len)]
        batch1.append(run_streaming(engine, [prompt], [args.single_output_len], prefix=f"b1-{repeat}"))
    step_seconds = sorted(s for run in batch1[1:] for s in run["_step_seconds"])
    result["batch1"] = {"input_len": args.single_input_len, "output_len": args.single_output_len,
                        "ttft_ms": statistics.median(run["ttft_ms_p50"] for run in batch1[1:]),
                        "tpot_ms": statistics.median(run["tpot_ms_p50"] for run in batch1[1:]),
                        "decode_step_ms_p50": 1000 * statistics.median(step_seconds) if step_seconds else None,
                        "runs": [{k: v for k, v in run.items() if k != "_step_seconds"} for run in batch1]}
    print(f"batch 1: TPOT {result['batch1']['tpot_ms']:.3f} ms, decode step P50 "
          f"{result['batch1']['decode_step_ms_p50'] or float('nan'):.3f} ms", flush=True)
    (out / "engine.json").write_text(json.dumps(result, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------- report

def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _get(data, *keys):
    for key in keys:
        if data is None:
            return None
        data = data[key] if isinstance(data, list) and isinstance(key, int) and len(data) > key else (
            data.get(key) if isinstance(data, dict) else None)
    return data


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _serve_row(serve: dict | None) -> dict:
    summary = _get(serve, "runs", 0, "summary")
    client = _get(serve, "runs", 0, "client")
    row = {"output_tokens_per_s": _get(summary, "output_throughput"), "duration_s": _get(summary, "duration_s"),
           "num_failed": _get(summary, "num_failed"), "num_output_tokens": _get(summary, "num_output_tokens"),
           "client_parse_ms_per_request": _get(client, "parse_ms_per_request", "mean"),
           "client_loop_lag_ms_p99": _get(client, "event_loop_lag_ms", "p99")}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for pct in ("p50", "p99"):
            row[f"{key[:-3]}_{pct}_ms"] = _get(summary, key, pct)
    return row


def report_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    engine = _load(out / "engine.json")
    runs = {name: _serve_row(_load(out / name / "serve.json")) for name in
            ("serve_sat", "serve_nostream", "serve_single", "serve_sat_sampled", "serve_sat_cprofile")}
    windows = {name: _load(out / "profile" / f"{name}.json") for name in
               ("serve_sat", "serve_nostream", "serve_single", "serve_sat_sampled", "serve_sat_cprofile")}
    engine_tps = _get(engine, "offline", "output_tokens_per_s")
    server_tps = runs["serve_sat"]["output_tokens_per_s"]
    ratio = server_tps / engine_tps if engine_tps and server_tps else None
    b1_step = _get(engine, "batch1", "decode_step_ms_p50")
    b1_tpot = _get(engine, "batch1", "tpot_ms")
    single_tpot = runs["serve_single"]["tpot_p50_ms"]
    summary = {"engine_output_tokens_per_s": engine_tps,
               "engine_streaming_output_tokens_per_s": _get(engine, "offline_streaming", "output_tokens_per_s"),
               "server_output_tokens_per_s": server_tps, "server_over_engine": ratio,
               "server_nostream_output_tokens_per_s": runs["serve_nostream"]["output_tokens_per_s"],
               "server_sampled_output_tokens_per_s": runs["serve_sat_sampled"]["output_tokens_per_s"],
               "engine_batch1_step_ms": b1_step, "engine_batch1_tpot_ms": b1_tpot,
               "server_single_tpot_ms": single_tpot,
               "single_over_batch1_step": single_tpot / b1_step if single_tpot and b1_step else None,
               "runs": runs, "engine": engine, "windows": {k: v for k, v in windows.items() if v}}
    lines = [f"# pagedkv serve against the offline engine, same requests ({_get(engine, 'model') or '?'}, "
             f"{_get(engine, 'provenance', 'device') or '?'}, commit {_get(engine, 'provenance', 'commit') or '?'})",
             "", "| measure | value | target |", "|---|---:|---|",
             f"| engine offline, output tok/s | {_fmt(engine_tps, 0)} | |",
             f"| engine stepped with stream_outputs on, output tok/s | "
             f"{_fmt(summary['engine_streaming_output_tokens_per_s'], 0)} | |",
             f"| server, streaming, rate inf, output tok/s | {_fmt(server_tps, 0)} | |",
             f"| server / engine | {_fmt(ratio, 3)} | >= 0.9 |",
             f"| server, non-streaming, output tok/s | {_fmt(runs['serve_nostream']['output_tokens_per_s'], 0)} | |",
             f"| server under the stack sampler, output tok/s | "
             f"{_fmt(runs['serve_sat_sampled']['output_tokens_per_s'], 0)} | |",
             f"| server TTFT / TPOT / ITL P50 (ms) | {_fmt(runs['serve_sat']['ttft_p50_ms'])} / "
             f"{_fmt(runs['serve_sat']['tpot_p50_ms'], 3)} / {_fmt(runs['serve_sat']['itl_p50_ms'], 3)} | |",
             f"| server TTFT / TPOT / ITL P99 (ms) | {_fmt(runs['serve_sat']['ttft_p99_ms'])} / "
             f"{_fmt(runs['serve_sat']['tpot_p99_ms'], 3)} / {_fmt(runs['serve_sat']['itl_p99_ms'], 3)} | |",
             f"| engine batch-1 decode step P50 / TPOT (ms) | {_fmt(b1_step, 3)} / {_fmt(b1_tpot, 3)} | |",
             f"| server single stream TPOT P50 (ms) | {_fmt(single_tpot, 3)} | |",
             f"| single stream / batch-1 step | {_fmt(summary['single_over_batch1_step'], 3)} | <= 1.10 |",
             f"| failed requests (sat / single) | {_fmt(runs['serve_sat']['num_failed'])} / "
             f"{_fmt(runs['serve_single']['num_failed'])} | 0 |"]
    lines += ["", "## Engine steps: offline against the server's engine thread", "",
              "| run | wall s | steps | step s | mean step ms | decode rows/step | prefill tok/step | schedule | "
              "build | launch | wait | update (ms/step) |", "|---|" + "---:|" * 11]
    step_rows = [("offline", _get(engine, "offline", "elapsed_s"), _get(engine, "offline", "steps")),
                 ("offline, stream_outputs", _get(engine, "offline_streaming", "elapsed_s"),
                  _get(engine, "offline_streaming", "steps"))]
    step_rows += [(name, _get(w, "wall_s"), _get(w, "steps")) for name, w in windows.items() if w]
    for name, wall, steps in step_rows:
        steps = steps or {}
        lines.append(f"| {name} | {_fmt(wall)} | {_fmt(steps.get('num_steps'))} | {_fmt(steps.get('step_s'))} | "
                     f"{_fmt(steps.get('mean_step_ms'), 3)} | {_fmt(steps.get('mean_decode_seqs'), 1)} | "
                     f"{_fmt(steps.get('mean_prefill_tokens'), 0)} | "
                     + " | ".join(_fmt(steps.get(f"mean_{p}_ms"), 3) for p in
                                  ("schedule", "build", "launch", "wait", "update")) + " |")
    lines += ["", "## Server engine thread and CPU by thread: shares of the span from the first to the last step", "",
              "| window | step | dispatch | apply commands | idle (blocking get) | other (metrics) | outputs "
              "dispatched | CPU: event loop | CPU: engine | CPU: tokenizer | CPU: all |",
              "|---|" + "---:|" * 10]
    for name, w in windows.items():
        if not w:
            continue
        loop, cpu = w["engine_loop"], w["thread_cpu"]
        total_cpu = sum(entry["cpu_s"] for entry in cpu.values()) / w["cpu_span_s"]

        def share(label_prefix: str) -> str:
            value = sum(e["cpu_share_of_wall"] for label, e in cpu.items() if label.startswith(label_prefix))
            return f"{value:.2f}"

        lines.append(f"| {name} | {loop['step']['share_of_wall']:.2f} | {loop['dispatch']['share_of_wall']:.2f} | "
                     f"{loop['drain_nonblocking']['share_of_wall']:.2f} | {loop['drain_blocking']['share_of_wall']:.2f}"
                     f" | {loop['other']['share_of_wall']:.2f} | {w['num_outputs_dispatched']:,} | "
                     f"{share('MainThread')} | {share('pagedkv-engine')} | {share('pagedkv-tokenizer')} | "
                     f"{total_cpu:.2f} |")
    sampled = _get(windows["serve_sat_sampled"], "sample", "threads") or {}
    if sampled:
        lines += ["", "## Stack samples (serve_sat_sampled, every 5 ms): busy share and top functions by thread",
                  ""]
        for name, thread in sorted(sampled.items(), key=lambda kv: -kv[1]["num_samples"] * kv[1]["busy_share"]):
            if thread["busy_share"] < 0.01:
                continue
            regions = ", ".join(f"{k} {v:.2f}" for k, v in thread["regions"].items())
            lines += [f"### {name}: busy {thread['busy_share']:.2f} of {thread['num_samples']} samples ({regions})",
                      "", "| inclusive | share | self | share |", "|---|---:|---|---:|"]
            for (inc, inc_share), (own, own_share) in zip(thread["top_inclusive"][:15], thread["top_self"][:15]):
                lines.append(f"| {inc} | {inc_share:.3f} | {own} | {own_share:.3f} |")
            lines.append("")
    cprofile = _get(windows["serve_sat_cprofile"], "cprofile")
    if cprofile:
        for thread in ("event_loop", "engine_thread"):
            lines += ["", f"## cProfile, {thread} (serve_sat_cprofile, by own time)", "", "```"]
            lines += [line for line in cprofile[thread] if line.strip()][:40]
            lines.append("```")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    engine = commands.add_parser("engine", help="run the offline engine and write the request files")
    engine.add_argument("--out", required=True)
    engine.add_argument("--model", default="random:qwen3-0.6b")
    engine.add_argument("--device", default=None)
    engine.add_argument("--dtype", default=None)
    engine.add_argument("--num-requests", type=int, default=256)
    engine.add_argument("--min-len", type=int, default=100)
    engine.add_argument("--max-len", type=int, default=1024)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=int, default=4096)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192)
    engine.add_argument("--kv-cache-memory", default="0.3", help="fraction or size, as `pagedkv serve` takes it")
    engine.add_argument("--single-input-len", type=int, default=128)
    engine.add_argument("--single-output-len", type=int, default=256)
    engine.add_argument("--random-num-requests", type=int, default=0,
                        help="also write requests_random.json (fixed lengths) and time the engine on it")
    engine.add_argument("--random-input-len", type=int, default=1024)
    engine.add_argument("--random-output-len", type=int, default=256)
    engine.add_argument("--skip-streaming", action="store_true", help="skip the stepped stream_outputs run")
    engine.set_defaults(func=engine_main)
    report = commands.add_parser("report", help="summarize DIR into summary.md and summary.json")
    report.add_argument("--out", required=True)
    report.set_defaults(func=report_main)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
