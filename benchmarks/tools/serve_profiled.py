"""`pagedkv serve`, unchanged, plus measurement windows: where the server's wall time goes, by thread.

    PYTHONPATH=src python3 benchmarks/tools/serve_profiled.py --profile-dir DIR -- random:qwen3-0.6b --port 8123 ...

Everything after `--` is `pagedkv serve`'s own argv: this calls `pagedkv.server.cli.main`, so the
engine, app and uvicorn are built exactly as the command builds them. It adds two routes:

    POST /profile/start?name=NAME&mode=steps|sample|cprofile     open a window
    POST /profile/stop                                           close it, write DIR/NAME.json

A window's figures cover the span from its first engine step to its last (the bench client's
start-up and exit fall outside). Every window records (cheaply, on every loop turn of the engine thread):
- the engine thread's wall time in `engine.step()`, delivering outputs (`_dispatch`), applying
  queued commands (`_drain_commands`, split into blocking-idle and non-blocking), and the rest
  (metrics updates);
- every step's shape and phases (`LLMEngine.step_timings`: schedule, build, launch, wait, update);
- each thread's CPU seconds from /proc/self/task (utime + stime, read every 0.1 s): with one interpreter lock,
  the event loop's CPU is time the engine thread cannot run Python.

`sample` adds a stack sampler: every 5 ms a daemon thread reads `sys._current_frames()` and counts,
per thread, each function's inclusive and self samples and the collapsed stacks (flame-graph
input). A thread counts as idle while its innermost frame is a wait (selector poll, queue get,
condition wait). `cprofile` runs `cProfile` on the event-loop thread and the engine thread
(each enabled on its own thread) and keeps their top functions by own time.
"""

import argparse
import asyncio
import collections
import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time
from pathlib import Path

SAMPLE_INTERVAL_S = 0.005
MAX_STACK_DEPTH = 48
#: (file name, function) of innermost frames that mean the thread is waiting, not working.
IDLE_LEAVES = {("selectors.py", "select"), ("threading.py", "wait"), ("queue.py", "get"),
               ("thread.py", "_worker"), ("socket.py", "accept"), ("threading.py", "_wait_for_tstate_lock")}
#: Engine-thread regions, by the AsyncEngine method the stack passes through (innermost wins).
ENGINE_REGIONS = (("_step", "engine.step"), ("_dispatch", "dispatch outputs"),
                  ("update_from_engine", "metrics update"), ("_drain_commands", "apply commands"))


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """Per native thread id of this process: (comm name, CPU seconds so far), from /proc/self/task."""
    ticks = os.sysconf("SC_CLK_TCK")
    result = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2:].split()
        result[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / ticks)  # utime, stime
    return result


def python_thread_names() -> dict[int, str]:
    """Native thread id -> Python thread name, for the threads Python knows."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


class StackSampler:
    """Every `interval_s`, every thread's stack (when `sample_stacks`); every 0.1 s, each thread's CPU time.

    Samples and CPU snapshots carry their time, so a report covers only the span the engine stepped.
    """

    def __init__(self, sample_stacks: bool, interval_s: float = SAMPLE_INTERVAL_S):
        self.sample_stacks = sample_stacks
        self.interval_s = interval_s if sample_stacks else 0.1
        self.samples: list[tuple[float, str, tuple]] = []
        self.cpu_snapshots: list[tuple[float, dict]] = [(time.perf_counter(), thread_cpu_s())]
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="profile-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        me = threading.get_ident()
        names = {}
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            if now - self.cpu_snapshots[-1][0] >= 0.1:
                self.cpu_snapshots.append((now, thread_cpu_s()))
            if not self.sample_stacks:
                continue
            frames = sys._current_frames()
            if any(ident not in names for ident in frames):
                names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in frames.items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < MAX_STACK_DEPTH:
                    code = frame.f_code
                    stack.append((os.path.basename(code.co_filename), code.co_name))
                    frame = frame.f_back
                self.samples.append((now, names.get(ident, str(ident)), tuple(reversed(stack))))
            self.num_samples += 1
        self.cpu_snapshots.append((time.perf_counter(), thread_cpu_s()))

    def cpu_between(self, start: float, end: float) -> tuple[float, dict[int, tuple[str, float]]]:
        """(seconds covered, CPU s per thread) between the last snapshot at or before `start` and the first
        at or after `end`."""
        first = max((snap for snap in self.cpu_snapshots if snap[0] <= start), default=self.cpu_snapshots[0],
                    key=lambda snap: snap[0])
        last = min((snap for snap in self.cpu_snapshots if snap[0] >= end), default=self.cpu_snapshots[-1],
                   key=lambda snap: snap[0])
        used = {tid: (comm, seconds - first[1].get(tid, (comm, 0.0))[1]) for tid, (comm, seconds) in last[1].items()}
        return last[0] - first[0], used

    def report(self, start: float, end: float, top: int = 25) -> dict:
        """Per thread, over [start, end]: samples, idle share, top functions (inclusive and self), engine
        regions, collapsed stacks."""
        stacks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for when, name, stack in self.samples:
            if start <= when <= end:
                stacks[name][stack] += 1
        threads = {}
        for name, counter in stacks.items():
            total = sum(counter.values())
            idle = sum(n for stack, n in counter.items() if stack and stack[-1] in IDLE_LEAVES)
            inclusive, own = collections.Counter(), collections.Counter()
            regions = collections.Counter()
            for stack, n in counter.items():
                for frame in set(stack):
                    inclusive[f"{frame[0]}:{frame[1]}"] += n
                if stack:
                    own[f"{stack[-1][0]}:{stack[-1][1]}"] += n
                region = "idle" if stack and stack[-1] in IDLE_LEAVES else "other"
                for fn, label in ENGINE_REGIONS:
                    if any(frame == ("async_engine.py", fn) for frame in stack):
                        region = label if region != "idle" else f"idle in {label}"
                        break
                regions[region] += n
            threads[name] = {
                "num_samples": total, "idle_share": idle / total if total else 0.0,
                "busy_share": 1 - idle / total if total else 0.0,
                "regions": {k: v / total for k, v in regions.most_common()},
                "top_inclusive": [[fn, n / total] for fn, n in inclusive.most_common(top)],
                "top_self": [[fn, n / total] for fn, n in own.most_common(top)],
                "collapsed": [";".join(f"{f}:{fn}" for f, fn in stack) + f" {n}" for stack, n in counter.most_common(400)],
            }
        return {"interval_ms": self.interval_s * 1000, "num_samples": sum(1 for when, _, _ in self.samples
                                                                          if start <= when <= end),
                "threads": threads}


class LoopClock:
    """Wall time of the engine thread's loop parts while a window is open (AsyncEngine methods wrapped)."""

    PARTS = ("step", "dispatch", "drain_blocking", "drain_nonblocking")

    def __init__(self):
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.calls = dict.fromkeys(self.PARTS, 0)
        self.num_outputs = 0
        self.blocking: list[tuple[float, float]] = []  # idle waits, clipped to the step span at the end
        self.first_step_start: float | None = None
        self.last_step_end: float | None = None

    def install(self) -> None:
        from pagedkv.server.async_engine import AsyncEngine

        clock = self
        step, dispatch, drain = AsyncEngine._step, AsyncEngine._dispatch, AsyncEngine._drain_commands

        def timed_step(engine_self):
            start = time.perf_counter()
            outputs = step(engine_self)
            if clock.active:
                if clock.first_step_start is None:
                    clock.first_step_start = start
                clock.last_step_end = time.perf_counter()
            clock._add("step", start)
            return outputs

        def timed_dispatch(engine_self, outputs):
            start = time.perf_counter()
            dispatch(engine_self, outputs)
            clock._add("dispatch", start)
            if clock.active:
                clock.num_outputs += len(outputs)

        def timed_drain(engine_self, block):
            start = time.perf_counter()
            result = drain(engine_self, block)
            if block:
                if clock.active:
                    clock.blocking.append((start, time.perf_counter()))
            else:
                clock._add("drain_nonblocking", start)
            return result

        AsyncEngine._step, AsyncEngine._dispatch, AsyncEngine._drain_commands = timed_step, timed_dispatch, timed_drain

    def _add(self, part: str, start: float) -> None:
        if self.active:
            self.seconds[part] += time.perf_counter() - start
            self.calls[part] += 1


class Windows:
    """The open measurement window (one at a time) and the routes that open and close it."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.clock = LoopClock()
        self.name: str | None = None

    async def start(self, app, name: str, mode: str) -> dict:
        if self.name is not None:
            return {"error": f"window {self.name!r} is open"}
        if mode not in ("steps", "sample", "cprofile"):
            return {"error": f"mode must be steps, sample or cprofile, got {mode!r}"}
        async_engine = app.state.async_engine
        self.name, self.mode = name, mode
        self.steps, self.timings = [], []

        def begin(engine):
            engine.step_timings = self.timings
            engine.on_step = lambda out, seconds: self.steps.append(
                (out.shape.prefill_tokens, out.shape.decode_seqs, out.shape.kv_tokens, seconds))
            self.engine_profile = cProfile.Profile() if mode == "cprofile" else None
            if self.engine_profile is not None:
                self.engine_profile.enable()
            self.clock.reset()
            self.clock.active = True

        await asyncio.wrap_future(async_engine.call(begin))
        self.loop_profile = cProfile.Profile() if mode == "cprofile" else None
        if self.loop_profile is not None:
            self.loop_profile.enable()  # this handler runs on the event-loop thread
        self.sampler = StackSampler(sample_stacks=mode == "sample")
        self.sampler.start()
        self.wall_start = time.perf_counter()
        return {"started": name, "mode": mode}

    async def stop(self, app) -> dict:
        if self.name is None:
            return {"error": "no window is open"}
        wall_s = time.perf_counter() - self.wall_start
        if self.loop_profile is not None:
            self.loop_profile.disable()
        self.sampler.stop()

        def end(engine):
            self.clock.active = False
            engine.step_timings, engine.on_step = None, None
            if self.engine_profile is not None:
                self.engine_profile.disable()

        await asyncio.wrap_future(app.state.async_engine.call(end))
        clock = self.clock
        # The span the engine stepped: the bench client's start-up and exit are not the server's time.
        span_start = clock.first_step_start if clock.first_step_start is not None else self.wall_start
        span_end = clock.last_step_end if clock.last_step_end is not None else time.perf_counter()
        span_s = max(span_end - span_start, 1e-9)
        clock.seconds["drain_blocking"] = sum(max(0.0, min(b, span_end) - max(a, span_start))
                                              for a, b in clock.blocking)
        clock.calls["drain_blocking"] = len(clock.blocking)
        cpu_span_s, cpu_used = self.sampler.cpu_between(span_start, span_end)
        names = python_thread_names()
        cpu = {}
        for tid, (comm, used) in cpu_used.items():
            label = names.get(tid, f"native:{comm}")
            entry = cpu.setdefault(label, {"cpu_s": 0.0, "num_threads": 0})
            entry["cpu_s"] += used
            entry["num_threads"] += 1
        for entry in cpu.values():
            entry["cpu_share_of_wall"] = entry["cpu_s"] / cpu_span_s if cpu_span_s else None  # no samples
        loop = {part: {"s": clock.seconds[part], "share_of_wall": clock.seconds[part] / span_s,
                       "calls": clock.calls[part]} for part in clock.PARTS}
        loop["other"] = {"s": span_s - sum(clock.seconds.values()),
                         "share_of_wall": 1 - sum(clock.seconds.values()) / span_s}
        report = {"name": self.name, "mode": self.mode, "window_s": wall_s, "wall_s": span_s,
                  "cpu_span_s": cpu_span_s, "engine_loop": loop,
                  "num_outputs_dispatched": clock.num_outputs,
                  "thread_cpu": dict(sorted(cpu.items(), key=lambda kv: -kv[1]["cpu_s"])),
                  "steps": step_summary(self.steps, self.timings)}
        if self.sampler.sample_stacks:
            report["sample"] = self.sampler.report(span_start, span_end)
        if self.loop_profile is not None:
            report["cprofile"] = {"event_loop": top_functions(self.loop_profile),
                                  "engine_thread": top_functions(self.engine_profile)}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.name}.json"
        path.write_text(json.dumps(report, indent=1))
        self.name = None
        return {"stopped": report["name"], "path": str(path), "wall_s": wall_s}

    def add_routes(self, app) -> None:
        from fastapi import Request  # resolved at definition: this module has no postponed annotations

        async def start(request: Request):
            return await self.start(request.app, request.query_params.get("name", "window"),
                                    request.query_params.get("mode", "steps"))

        async def stop(request: Request):
            return await self.stop(request.app)

        app.add_api_route("/profile/start", start, methods=["POST"])
        app.add_api_route("/profile/stop", stop, methods=["POST"])


def step_summary(steps: list[tuple], timings: list) -> dict:
    """Counts, shapes and phase times of a window's steps (the offline helper summarizes its run alike)."""
    if not steps:
        return {"num_steps": 0}
    num = len(steps)
    summary = {"num_steps": num, "step_s": sum(s[3] for s in steps),
               "mean_step_ms": 1000 * sum(s[3] for s in steps) / num,
               "mean_decode_seqs": sum(s[1] for s in steps) / num,
               "mean_prefill_tokens": sum(s[0] for s in steps) / num,
               "num_mixed_steps": sum(1 for s in steps if s[0] and s[1]),
               "num_decode_only_steps": sum(1 for s in steps if s[1] and not s[0])}
    if timings:
        for phase in ("schedule_s", "build_s", "launch_s", "wait_s", "update_s"):
            summary[f"mean_{phase[:-2]}_ms"] = 1000 * sum(getattr(t, phase) for t in timings) / len(timings)
    return summary


def top_functions(profile: cProfile.Profile, top: int = 30) -> list[str]:
    """The profile's `top` functions by own time, as pstats prints them."""
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    return stream.getvalue().splitlines()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile-dir", required=True, help="where each window's NAME.json goes")
    args = parser.parse_args(argv[:split])
    windows = Windows(Path(args.profile_dir))
    windows.clock.install()
    import pagedkv.server.app as server_app
    from pagedkv.server import cli

    create_app = server_app.create_app

    def create_app_with_windows(*a, **kw):
        app = create_app(*a, **kw)
        windows.add_routes(app)
        return app

    server_app.create_app = create_app_with_windows
    return cli.main(argv[split + 1:], prog="serve_profiled.py")


if __name__ == "__main__":
    sys.exit(main())
