"""Where a warm turn's TTFT goes, host and device side by side: a torch.profiler trace of a few warm turns of
the chat-tiers workload through GPU + host tier (+ disk tier), one turn in flight.

    PYTHONPATH=src python3 benchmarks/tools/tiers_warm_timeline.py --out DIR [--chat-size 32,8,3,16384,1]
        [--host-memory 24GiB] [--no-disk] [--profiled-turns 6] [--first-profiled-turn N]
        [--in-step-restore-tokens T] [--late-restore] [--write-through]

The engine is built as the chat-tiers bench builds its tiered configuration (random weights, bf16, the GPU pool
~10% of the distinct prefix blocks, full graphs). The workload's turns run one at a time; the turns before the
profiled window warm the caches and Triton's compiles (`--first-profiled-turn N` starts the window at turn N,
e.g. 8 for the first warm turn after the cold first uses of 8 system prompts; another seed's workload then runs
through a warm-up engine first, so that the early window compiles nothing). For each profiled turn whose system
prompt an earlier turn sent, the tool prints, in ms from its submission: the host's ranges (step calls and,
inside them, schedule, build, block moves, launch, the wait for the device) and the device's busy spans per
stream (kernels and copies merged where less than 30 us apart, with their first names). Writes `timeline.txt`
and `trace.json.gz` (the Chrome trace of the window) under DIR; asserts nothing. A CPU smoke (no device spans):
`--device cpu --model tiny-qwen3 --chat-size 8,2,3,256,1 --host-memory 64MiB`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gzip
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pagedkv.bench.engine_chat_tiers import DISK_CAP_BYTES, chat_pool_blocks, chat_workload, warm_kernels
from pagedkv.cli import parse_size
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.models.loader import random_model

GAP_US = 30.0  # device events closer than this on one stream are one span


def annotate(obj, name: str, label: str) -> None:
    """Wrap `obj.name` in a record_function range called `label`."""
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return inner(*args, **kwargs)

    setattr(obj, name, wrapped)


def build(args, disk_dir: Path | None):
    conversations, systems, num_turns, system_len, in_flight = (int(x) for x in args.chat_size.split(","))
    device = torch.device(args.device)
    model = random_model(args.model, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    if device.type != "cuda":
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, 4096)
    workload = chat_workload((conversations, systems, num_turns, system_len), model)
    block_size = 16
    num_blocks = chat_pool_blocks(workload, in_flight, block_size)
    host = parse_size(args.host_memory)
    options = dict(hf_model=model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=in_flight,
                   max_model_len=workload.max_conversation_tokens, max_num_batched_tokens=4096,
                   kv_offload_memory=host, device=str(device))
    if disk_dir is not None:
        options.update(kv_offload_dir=str(disk_dir), kv_offload_disk_bytes=max(DISK_CAP_BYTES, host))
    if args.in_step_restore_tokens is not None:
        options["kv_offload_in_step_restore_tokens"] = args.in_step_restore_tokens
    if args.late_restore:
        options["kv_offload_early_restore"] = False
    if args.write_through:
        options["kv_offload_write_through"] = True
    return LLM(**options), workload, num_blocks, options


def spans(events: list[dict]) -> list[tuple[float, float, int, list[str]]]:
    """Device events of one stream merged into (start, end, count, first names) where less than GAP_US apart."""
    out: list[list] = []
    for event in sorted(events, key=lambda e: e["ts"]):
        start, end = event["ts"], event["ts"] + event.get("dur", 0)
        if out and start - out[-1][1] < GAP_US:
            out[-1][1] = max(out[-1][1], end)
            out[-1][2] += 1
            if len(out[-1][3]) < 3 and event["name"] not in out[-1][3]:
                out[-1][3].append(event["name"])
        else:
            out.append([start, end, 1, [event["name"]]])
    return [tuple(span) for span in out]


def describe(trace: dict, windows: list[tuple[str, float, float]]) -> str:
    """Per window (label, submission ts, end ts in the trace's us): host ranges and device spans, ms from the
    submission."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    host = [e for e in events if e.get("cat") == "user_annotation"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    lines = []
    for label, t0, t1 in windows:
        lines.append(f"\n## {label}: first token after {(t1 - t0) / 1e3:.2f} ms")
        for e in sorted((e for e in host if t0 <= e["ts"] <= t1), key=lambda e: e["ts"]):
            lines.append(f"host  {(e['ts'] - t0) / 1e3:8.2f} +{e.get('dur', 0) / 1e3:7.2f}  {e['name']}")
        by_stream: dict = {}
        for e in device:
            if e["ts"] + e.get("dur", 0) >= t0 and e["ts"] <= t1:
                by_stream.setdefault(e.get("tid"), []).append(e)
        for stream, items in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
            for start, end, count, names in spans(items):
                lines.append(f"dev {str(stream)[-6:]:>6} {(start - t0) / 1e3:8.2f} +{(end - start) / 1e3:7.2f}  "
                             f"{count:4d} x {', '.join(n[:48] for n in names)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--chat-size", default="32,8,3,16384,1", help="C,K,T,S,F as the chat-tiers bench's")
    parser.add_argument("--host-memory", default="24GiB")
    parser.add_argument("--no-disk", action="store_true")
    parser.add_argument("--profiled-turns", type=int, default=6)
    parser.add_argument("--first-profiled-turn", type=int, default=None,
                        help="the window's first turn (default: half-way, or after two turns per system prompt)")
    parser.add_argument("--in-step-restore-tokens", type=int, default=None)
    parser.add_argument("--write-through", action="store_true", help="copy committed blocks to the host early")
    parser.add_argument("--late-restore", action="store_true",
                        help="issue each restore's copies with the step's moves, not at admission")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the tool (tiny-qwen3, small chat)")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    disk_dir = None if args.no_disk else Path(tempfile.mkdtemp(prefix="kv_timeline."))
    llm, workload, num_blocks, options = build(args, disk_dir)
    turns = workload.fixed_turns()
    if args.first_profiled_turn is None:
        first_window = max(len(turns) // 2, workload.num_system_prompts * 2)
    else:  # Triton's compiles first, on a warm-up engine (no disk tier) and another seed's conversations
        first_window = args.first_profiled_turn
        warm = {key: value for key, value in options.items() if not key.startswith("kv_offload_disk")}
        warm.pop("kv_offload_dir", None)
        seconds = warm_kernels(LLM(**warm), dataclasses.replace(workload, seed=workload.seed + 1),
                               warm["max_num_seqs"])
        print(f"warm-up: another seed's workload through a warm-up engine, {seconds:.1f} s", flush=True)
    engine = llm.engine
    engine.stream_outputs = True
    window = turns[first_window:first_window + args.profiled_turns]
    ttft: dict[str, float] = {}

    def run_turn(index: int, prompt: list[int], answer_len: int, profiled: bool) -> tuple[float, int]:
        request_id = f"turn-{index}"
        params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
        with torch.profiler.record_function(f"submit {request_id}") if profiled else contextlib.nullcontext():
            engine.add_request(request_id, prompt, params)
        start = time.perf_counter()
        got_first = False
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if not got_first and any(o.request_id == request_id and o.outputs and o.outputs[0].token_ids
                                     for o in outputs):
                got_first = True
                ttft[request_id] = time.perf_counter() - start
                if profiled:
                    with torch.profiler.record_function(f"first token {request_id}"):
                        pass
        return ttft.get(request_id, float("nan")), index

    for index, (_, _, prompt, answer_len) in enumerate(turns[:first_window]):
        run_turn(index, prompt, answer_len, False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    annotate(engine, "step", "engine.step")
    annotate(engine.scheduler, "schedule", "schedule")
    annotate(engine.input_builder, "build", "build")
    annotate(engine.runner, "execute", "execute")
    annotate(engine, "_complete", "wait for the device")
    if engine.runner.offload is not None:
        annotate(engine.runner.offload, "move", "block moves")
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for offset, (_, _, prompt, answer_len) in enumerate(window):
            run_turn(first_window + offset, prompt, answer_len, True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    raw = out / "trace.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with open(raw, "rb") as src, gzip.open(out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    marks = {e["name"]: e["ts"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    windows = []
    for offset in range(len(window)):
        request_id = f"turn-{first_window + offset}"
        if f"submit {request_id}" in marks and f"first token {request_id}" in marks:
            windows.append((f"{request_id} (TTFT {ttft[request_id] * 1e3:.2f} ms by the loop's clock)",
                            marks[f"submit {request_id}"], marks[f"first token {request_id}"]))
    header = (f"# {args.model}, chat {args.chat_size}, GPU pool {num_blocks} blocks, host tier {args.host_memory}, "
              f"disk {'off' if disk_dir is None else 'on'}; profiled turns {first_window}.."
              f"{first_window + len(window) - 1}; streams: the device spans' tid\n")
    text = header + describe(trace, windows)
    (out / "timeline.txt").write_text(text)
    print(text)
    llm.shutdown()
    if disk_dir is not None:
        shutil.rmtree(disk_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
