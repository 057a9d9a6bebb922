"""What the server path costs per streamed token, on CPU: `pagedkv serve`'s app over an engine stand-in.

    PYTHONPATH=src python3 benchmarks/tools/server_overhead.py run --out DIR [--modes in-process,engine-process]
        [--num-streams 256] [--num-tokens 256] [--step-ms 10] [--busy-ms 2] [--profile]

The engine is `pagedkv.bench.serve.fake_engine.FakeEngine`: every `step_ms` it gives each of up
to 256 running requests one token (holding the interpreter lock `busy_ms` a step, as the real
engine's host work does), so the only thing measured is the server: the engine thread's hand-off,
the event loop building and writing SSE chunks, uvicorn, and (with `engine-process`) the pipe
and the parent's rebuilding of outputs. `run` starts one server process per mode (this file's
`serve` subcommand, which builds the app exactly as `pagedkv serve` does, plus two measurement
routes), then a raw-socket client in this process streams `num-streams` requests of
`num-tokens` tokens at once. A stand-in at 256 rows per 10 ms offers 25.6k tok/s, the H200's
offline rate on nano-vllm's workload: a server that keeps up delivers it.

Per mode it reports output tok/s against the stand-in's offered rate, TTFT and ITL P50/P99 as
the client saw them, chunks per token (below 1 when the server merged a stream's tokens), and,
from the server process, CPU seconds per thread over the run: the event loop's share of the
wall clock and its microseconds per delivered token are what a faster server path must cut.
`--profile` adds cProfile of the event-loop thread (top functions by own time) to the JSON.
Results: DIR/server_overhead.json and .md. Benchmarks never assert.

    PYTHONPATH=src python3 benchmarks/tools/server_overhead.py chunks [--num-streams 256] [--num-tokens 64]

`chunks` times the event loop's own share without a network or a server: `stream_events` of 256
streams fed one output each per step straight into their `RequestStream`s, consumed to the end; it
prints CPU microseconds per chunk (the hand-off, waiting, and building the SSE bytes; not uvicorn).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MODES = ("in-process", "engine-process")


# ---------------------------------------------------------------------------------------------- server side

def thread_cpu_s(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) per thread of process `pid`, keyed 'name/tid' (Python's thread names
    for this process, the kernel's for others)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()} if pid == "self" else {}
    ticks = os.sysconf("SC_CLK_TCK")
    result = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        result[f"{names.get(int(tid), comm)}/{tid}"] = (int(fields[11]) + int(fields[12])) / ticks
    return result


def _children_cpu_s() -> dict[str, float]:
    import multiprocessing

    total = {}
    for child in multiprocessing.active_children():
        for name, seconds in thread_cpu_s(child.pid).items():
            total[f"child:{name}"] = seconds
    return total


class Window:
    """Per-thread CPU (this process and its children), wall time and optional cProfile of the event loop."""

    def __init__(self, engine, profile: bool):
        self.engine = engine
        self.profiler = cProfile.Profile() if profile else None
        self.start_wall = time.perf_counter()
        self.start_cpu = {**thread_cpu_s(), **_children_cpu_s()}
        self.start_steps = self._steps()
        if self.profiler is not None:
            self.profiler.enable()  # on the calling thread: the event loop's

    def _steps(self) -> int | None:
        stats = self.engine.latest_stats()
        return getattr(stats, "num_steps", None)

    def close(self) -> dict:
        if self.profiler is not None:
            self.profiler.disable()
        wall = time.perf_counter() - self.start_wall
        end_cpu = {**thread_cpu_s(), **_children_cpu_s()}
        cpu = {name: end_cpu[name] - self.start_cpu.get(name, 0.0) for name in end_cpu}
        result = {"wall_s": wall, "thread_cpu_s": {k: round(v, 3) for k, v in cpu.items() if v > 0.005},
                  "event_loop_cpu_s": sum(v for k, v in cpu.items() if not k.startswith("child:")
                                          and k.split("/")[1] == str(os.getpid())),
                  "num_steps": (self._steps() or 0) - (self.start_steps or 0) if self.start_steps is not None else None}
        if self.profiler is not None:
            text = io.StringIO()
            stats = pstats.Stats(self.profiler, stream=text)
            stats.sort_stats("tottime").print_stats(35)
            result["event_loop_profile"] = text.getvalue()[-12000:]
        return result


def serve_main(args: argparse.Namespace) -> int:
    from pagedkv.bench.serve.fake_engine import FakeEngine, FakeEngineConfig
    from pagedkv.server.app import create_app
    from pagedkv.server.cli import bind, freeze_heap, serve

    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    fake = FakeEngineConfig(step_ms=args.step_ms, busy_ms=args.busy_ms, max_num_seqs=args.max_num_seqs)
    if args.mode == "engine-process":
        from pagedkv.distributed.data_parallel import DataParallelEngine
        from pagedkv.engine.config import EngineConfig

        engine = DataParallelEngine(EngineConfig(device="cpu", max_model_len=fake.max_model_len), 1,
                                    engine_factory=FakeEngine.factory(fake))
    else:
        engine = FakeEngine(fake)
    app = create_app(engine, "fake")
    windows: dict[str, Window] = {}

    @app.post("/_overhead/start")
    async def start(profile: bool = False) -> dict:
        windows["run"] = Window(engine, profile)
        return {"ok": True}

    @app.post("/_overhead/stop")
    async def stop() -> dict:
        return windows.pop("run").close()

    sock = bind("127.0.0.1", args.port)
    freeze_heap()  # as `pagedkv serve` does
    try:
        http, loop = ("h11", "asyncio") if args.uvicorn == "h11" else ("auto", "auto")
        return serve(app, sock, log_level="warning", http=http, loop=loop)
    finally:
        sock.close()
        engine.shutdown()


# ---------------------------------------------------------------------------------------------- client side

_USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def _stream(port: int, body: bytes, t0: float) -> dict:
    """One streamed completion over a raw socket: chunk arrival times and the usage's token count."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    times, counts, tail, status = [], [], b"", None
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            if status is None:
                status = int(data[9:12])
            events = data.count(b"data: ")
            if events:
                times.append(now)
                counts.append(events)
            tail = (tail + data)[-4096:]
            if b"data: [DONE]" in tail:
                break
    finally:
        writer.close()
    match = _USAGE.findall(tail)
    num_tokens = int(match[-1]) if match else 0
    return {"status": status, "start_s": start - t0, "end_s": time.perf_counter() - t0, "num_tokens": num_tokens,
            "chunk_s": [t - t0 for t in times], "events": counts}


async def _load(port: int, num_streams: int, num_tokens: int, prompt_len: int) -> dict:
    t0 = time.perf_counter()
    bodies = [json.dumps({"model": "fake", "prompt": [100 + (i + j) % 1000 for j in range(prompt_len)],
                          "max_tokens": num_tokens, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}, "return_token_ids": True}).encode()
              for i in range(num_streams)]
    results = await asyncio.gather(*(_stream(port, body, t0) for body in bodies))
    return {"wall_s": time.perf_counter() - t0, "streams": results}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(load: dict, server: dict, offered_tok_s: float) -> dict:
    """Client figures (throughput, TTFT, ITL, chunks per token) beside the server's CPU by thread."""
    streams = load["streams"]
    ok = [s for s in streams if s["status"] == 200]
    tokens = sum(s["num_tokens"] for s in ok)
    span = max(s["end_s"] for s in ok) - min(s["start_s"] for s in ok) if ok else 0.0
    ttft = [1000 * (s["chunk_s"][0] - s["start_s"]) for s in ok if s["chunk_s"]]
    itl = [1000 * (b - a) for s in ok for a, b in zip(s["chunk_s"], s["chunk_s"][1:])]
    num_events = sum(sum(s["events"]) for s in ok)
    loop_cpu = server.get("event_loop_cpu_s", 0.0)
    threads = server.get("thread_cpu_s", {})
    by_name: dict[str, float] = {}
    for key, seconds in threads.items():
        name = key.rsplit("/", 1)[0]
        by_name[name] = by_name.get(name, 0.0) + seconds
    wall = server.get("wall_s") or span
    return {"num_ok": len(ok), "num_failed": len(streams) - len(ok), "num_output_tokens": tokens,
            "output_tokens_per_s": tokens / span if span else None, "offered_tokens_per_s": offered_tok_s,
            "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
            "itl_ms_p50": _pct(itl, 0.5), "itl_ms_p99": _pct(itl, 0.99),
            "chunks_per_token": num_events / tokens if tokens else None,
            "event_loop_share": loop_cpu / wall if wall else None,
            "event_loop_us_per_token": 1e6 * loop_cpu / tokens if tokens else None,
            "cpu_share_by_thread": {k: round(v / wall, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
            "num_steps": server.get("num_steps")}


def _post(port: int, path: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _wait_healthy(port: int, process: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return True
        except OSError:
            time.sleep(0.3)
    return False


def run_mode(args: argparse.Namespace, mode: str, out: Path) -> dict:
    """One server process in `mode`: warm up, then the measured run; the server's window and the client's view."""
    command = [sys.executable, __file__, "serve", "--mode", mode, "--port", str(args.port), "--step-ms",
               str(args.step_ms), "--busy-ms", str(args.busy_ms), "--max-num-seqs", str(args.max_num_seqs),
               "--switch-interval-ms", str(args.switch_interval_ms), "--uvicorn", args.uvicorn]
    log = open(out / f"server_{mode}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        if not _wait_healthy(args.port, process):
            return {"error": f"the {mode} server did not come up (see server_{mode}.log)"}
        asyncio.run(_load(args.port, 8, 16, 16))  # warm-up: first requests, imports, connection set-up
        _post(args.port, f"/_overhead/start?profile={'true' if args.profile else 'false'}")
        load = asyncio.run(_load(args.port, args.num_streams, args.num_tokens, args.prompt_len))
        server = _post(args.port, "/_overhead/stop")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
    offered = min(args.num_streams, args.max_num_seqs) / (max(args.step_ms, args.busy_ms) / 1000) \
        if max(args.step_ms, args.busy_ms) else float("inf")
    result = summarize(load, server, offered)
    if "event_loop_profile" in server:
        result["event_loop_profile"] = server["event_loop_profile"]
    return result


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def run_main(args: argparse.Namespace) -> int:
    from pagedkv.results import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": "server_overhead", "provenance": provenance(),
               "config": {k: v for k, v in vars(args).items() if k != "func"}, "modes": {}}
    for mode in args.modes.split(","):
        results["modes"][mode] = run_mode(args, mode, out)
        row = results["modes"][mode]
        print(f"{mode}: {_fmt(row.get('output_tokens_per_s'), 0)} tok/s of {_fmt(row.get('offered_tokens_per_s'), 0)}"
              f" offered; event loop {_fmt(row.get('event_loop_share'), 2)} busy, "
              f"{_fmt(row.get('event_loop_us_per_token'))} us/token; ITL P99 {_fmt(row.get('itl_ms_p99'))} ms",
              flush=True)
    (out / "server_overhead.json").write_text(json.dumps(results, indent=1))
    lines = [f"# Server path over an engine stand-in ({args.num_streams} streams x {args.num_tokens} tokens, "
             f"step {args.step_ms} ms, host work {args.busy_ms} ms/step; {results['provenance']['commit']})", "",
             "| mode | tok/s | offered | TTFT P50/P99 ms | ITL P50/P99 ms | chunks/token | event loop busy | "
             "loop us/token | CPU share by thread |", "|---|---:|---:|---|---|---:|---:|---:|---|"]
    for mode, row in results["modes"].items():
        if "error" in row:
            lines.append(f"| {mode} | {row['error']} |")
            continue
        threads = ", ".join(f"{k} {v}" for k, v in list(row["cpu_share_by_thread"].items())[:5])
        lines.append(f"| {mode} | {_fmt(row['output_tokens_per_s'], 0)} | {_fmt(row['offered_tokens_per_s'], 0)} | "
                     f"{_fmt(row['ttft_ms_p50'])} / {_fmt(row['ttft_ms_p99'])} | {_fmt(row['itl_ms_p50'])} / "
                     f"{_fmt(row['itl_ms_p99'])} | {_fmt(row['chunks_per_token'], 2)} | "
                     f"{_fmt(row['event_loop_share'], 2)} | {_fmt(row['event_loop_us_per_token'])} | {threads} |")
    (out / "server_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def chunks_main(args: argparse.Namespace) -> int:
    """CPU per chunk of `stream_events` + `RequestStream`, in this process, no network."""
    from pagedkv.engine.outputs import CompletionOutput, RequestOutput
    from pagedkv.engine.sampling_params import SamplingParams
    from pagedkv.server import serving
    from pagedkv.server.request_stream import RequestStream

    class Client:
        async def is_disconnected(self) -> bool:
            return False

    class Engine:
        def abort(self, request_id: str) -> None:
            pass

    async def run() -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        params = SamplingParams(max_tokens=args.num_tokens, ignore_eos=True)
        jobs = [serving.Job(f"cmpl-{i:032x}", 1_700_000_000, [f"cmpl-{i:032x}-0"], [[1] * args.prompt_len], params,
                            RequestStream(loop), Engine()) for i in range(args.num_streams)]

        async def consume(job) -> int:
            return sum([1 async for _ in serving.stream_events(job, Client(), "random:qwen3-0.6b", False, True,
                                                              True, str)])

        tasks = [asyncio.ensure_future(consume(job)) for job in jobs]
        await asyncio.sleep(0)
        start = time.process_time()
        for step in range(args.num_tokens):
            done = step == args.num_tokens - 1
            for job in jobs:
                completion = CompletionOutput(0, "", list(range(1000, 1001 + step)), "length" if done else None)
                job.stream.put(RequestOutput(job.request_ids[0], None, job.prompts[0], [completion], done))
            for _ in range(3):  # let every consumer take its output
                await asyncio.sleep(0)
        num_chunks = sum(await asyncio.gather(*tasks))
        return time.process_time() - start, num_chunks

    cpu_s, num_chunks = asyncio.run(run())
    print(f"{1e6 * cpu_s / num_chunks:.1f} us of CPU per chunk ({num_chunks} chunks, {args.num_streams} streams)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    chunks = sub.add_parser("chunks")
    chunks.add_argument("--num-streams", type=int, default=256)
    chunks.add_argument("--num-tokens", type=int, default=64)
    chunks.add_argument("--prompt-len", type=int, default=128)
    for name in ("run", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--port", type=int, default=8131)
        p.add_argument("--step-ms", type=float, default=10.0)
        p.add_argument("--busy-ms", type=float, default=2.0)
        p.add_argument("--max-num-seqs", type=int, default=256)
        p.add_argument("--switch-interval-ms", type=float, default=0.0,
                       help="the server's sys.setswitchinterval (0: Python's default, 5 ms)")
        p.add_argument("--uvicorn", choices=("auto", "h11"), default="h11",
                       help="h11: uvicorn on h11 and asyncio (what a bare install has); auto: httptools and "
                            "uvloop where installed (default %(default)s)")
    sub.choices["serve"].add_argument("--mode", choices=MODES, default="in-process")
    run = sub.choices["run"]
    run.add_argument("--out", default=os.environ.get("PAGEDKV_OUT", "out/server_overhead"))
    run.add_argument("--modes", default=",".join(MODES))
    run.add_argument("--num-streams", type=int, default=256)
    run.add_argument("--num-tokens", type=int, default=256)
    run.add_argument("--prompt-len", type=int, default=128)
    run.add_argument("--profile", action="store_true", help="cProfile the server's event loop")
    args = parser.parse_args(argv)
    return {"serve": serve_main, "run": run_main, "chunks": chunks_main}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
