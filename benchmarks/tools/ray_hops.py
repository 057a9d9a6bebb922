"""Where a request's first token goes on the Ray path: Ray's and Serve's floors beside the engine deployment's calls.

One request at a time from a driver (no ingress, no HTTP), each figure a P50 over CALLS calls after
WARMUP. Per settings group, in a Ray cluster of its own (a child process of this one, the group's
Serve settings in its environment, which Ray's processes inherit, and in the job's runtime_env):

    actor call          a plain Ray actor's method, awaited (no Serve): the transport's floor
    actor stream        a plain Ray actor's streaming method that yields one item: its first item
    echo stream         a Serve deployment whose streaming method yields one item at once, Serve's
                        default router: the floor of a Serve handle call
    echo replica        the same deployment driven as the engine deployment is (below): each `generate`
                        queues one finished output at once for the `outputs` stream: the floor of a
                        request's first output through Serve, with an engine that takes no time
    echo, pagedkv rtr   the same with a `generate`-shaped call routed by PagedKVRequestRouter
    engine <router>     the engine deployment (`EngineReplica`, 8 prompt tokens, 2 out) with pagedkv's
                        request router or Serve's default one: the `generate` call's first item (the
                        replica's id), the first output on the `outputs` stream, the end of the call;
                        and the first output's path in three legs, timed on the host's monotonic clock
                        (the same in every process): the call until `generate` runs in the replica
                        (to_replica), until the first output is queued there (in_replica: the engine),
                        and its trip on the `outputs` stream to the driver (output_trip)
    ..., gRPC           the same calls over Serve's gRPC transport, taken per handle
                        (`handle.options(_by_reference=False)`; every replica serves it), not by
                        RAY_SERVE_USE_GRPC_BY_DEFAULT for the whole cluster
    engine, RayEngineClient  the same requests through the ingress's engine client (`RayEngineClient`
                        as the ingress builds it, gRPC included; add_request and step() from a
                        thread, its loop a thread of its own; the
                        groups whose router runs on its own loop): the first output
    engine alone        the same request on the engine in the driver's process (default group only)

Per Serve row also: how many times the handle's router probed replica queue lengths per call
(Serve's `_probe_queue_lens`; zero when its queue-length cache is fresh) and the time the handle
spent choosing a replica (`_choose_replica_for_request`). Groups (GROUPS, default all three):
`default` (Ray's defaults), `same-loop` (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 and
RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0), `throughput` (RAY_SERVE_THROUGHPUT_OPTIMIZED=1: the same
plus gRPC between handles and replicas). Prints a table and writes ray_hops.json to --out
($PAGEDKV_OUT, default out/ray_hops). Benchmarks never assert.

Runs on a CPU with a tiny model as written (about 3 minutes on 2 cores); on a GPU machine set
MODEL (e.g. random:qwen3-0.6b) and DEVICE=cuda:

    PYTHONPATH=$PWD/src python benchmarks/tools/ray_hops.py [--groups default,throughput] [--out DIR]
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

GROUPS = {
    "default": {},
    "same-loop": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"},
    "throughput": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


class _RouterCounters:
    """Counts a handle's queue-length probes and times its replica choices, patched onto its live router.

    On the instance (after the handle's first call built it), not the class: the class's methods
    may reach the router as a pickled copy, which would count into a copy of this object."""

    def __init__(self, handle):
        self.num_probes = 0
        self.choose_ms: list[float] = []
        try:
            router = handle._router._asyncio_router.request_router
        except AttributeError:  # another Serve: no figures, the latencies still stand
            self.num_probes = self.choose_ms = None
            return
        probe, choose = router._probe_queue_lens, router._choose_replica_for_request

        async def counted_probe(*args, **kwargs):
            self.num_probes += 1
            return await probe(*args, **kwargs)

        async def timed_choose(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await choose(*args, **kwargs)
            finally:
                self.choose_ms.append((time.perf_counter() - t0) * 1e3)

        router._probe_queue_lens, router._choose_replica_for_request = counted_probe, timed_choose

    def row(self, num_calls: int) -> dict:
        if self.choose_ms is None:
            return {}
        return {"probes_per_call": round(self.num_probes / num_calls, 2), "choose_ms": p50(self.choose_ms)}


async def _timed(calls: int, warmup: int, one) -> list[float]:
    """Milliseconds of `await one()` (which returns its own duration) over calls after warmup."""
    for _ in range(warmup):
        await one()
    return [await one() for _ in range(calls)]


async def _first_item_ms(gen, resolve=False) -> float:
    t0 = time.perf_counter()
    first = None
    async for item in gen:
        if resolve:
            await item
        if first is None:
            first = time.perf_counter()
    return (first - t0) * 1e3


def run_group(name: str, calls: int, warmup: int) -> dict:
    """This process's Ray cluster: every variant's figures (see the module docstring)."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedkv.deploy.ray_client import RayEngineClient
    from pagedkv.deploy.ray_serve import RayServeConfig, engine_deployment
    from pagedkv.deploy.replica import EngineReplica, unpack_messages
    from pagedkv.deploy.request_router import GENERATE_METHOD
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.sampling_params import SamplingParams

    cfg = EngineConfig(model=os.environ.get("MODEL", "random:tiny-llama"), device=os.environ.get("DEVICE", "cpu"),
                       block_size=16, num_blocks=256, max_model_len=512)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rows: dict[str, dict] = {}
    if name == "default":  # first, before Ray's processes share the machine
        rows["engine alone"] = {"first_output_ms": engine_alone_ms(cfg, params, calls, warmup)}
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ["PYTHONPATH"], **GROUPS[name]}
    ray.init(address="local", num_cpus=3, include_dashboard=False, runtime_env={"env_vars": env})  # a cluster of its own

    @ray.remote(num_cpus=0)
    class Plain:
        async def ping(self):
            return 1

        async def stream(self):
            yield 1

    class Echo:
        """`EngineReplica`'s two calls over an engine that answers at once (one finished output per request)."""

        def __init__(self):
            self._outboxes: dict[str, asyncio.Queue] = {}
            self._hops: dict[str, list] = {}  # request id -> [generate entered, first output queued] (perf_counter)

        def _outbox(self, sender: str) -> asyncio.Queue:  # made on the loop the calls run on
            return self._outboxes.setdefault(sender, asyncio.Queue())

        async def generate(self, request_id, token_ids, params, block_hashes=None, sender=""):
            now = time.perf_counter()
            self._hops[request_id] = [now, now]
            self._outbox(sender).put_nowait(("output", types.SimpleNamespace(request_id=request_id, finished=True)))
            yield "echo"

        async def outputs(self, sender, replica=""):
            outbox = self._outbox(sender)
            while True:
                yield [await outbox.get()], None

        def hop_times(self) -> dict:
            return self._hops

    class TimedReplica(EngineReplica):
        """`EngineReplica` noting when each `generate` call entered and when its first output was queued."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._hops: dict[str, list] = {}

        async def generate(self, request_id, *args, **kwargs):
            self._hops[request_id] = [time.perf_counter(), None]
            async for item in super().generate(request_id, *args, **kwargs):
                yield item

        def _outbox(self, sender):
            outbox = super()._outbox(sender)
            if "put" not in vars(outbox):  # wrap each outbox's put once
                put = outbox.put

                def timed_put(message):
                    hop = self._hops.get(message[1].request_id) if message[0] == "output" else None
                    if hop is not None and hop[1] is None:
                        hop[1] = time.perf_counter()
                    put(message)

                outbox.put = timed_put
            return outbox

        def hop_times(self) -> dict:
            return self._hops

    pagedkv_router = RequestRouterConfig(request_router_class="pagedkv.deploy.request_router.PagedKVRequestRouter",
                                         request_router_kwargs={"policy": "prefix", "block_size": 16})

    async def echo_rows(handle, label):
        h = handle.options(stream=True)
        one = lambda: _first_item_ms(  # noqa: E731
            getattr(h, GENERATE_METHOD).remote(uuid.uuid4().hex, PROMPT, params, block_hashes=None, sender="s"))
        await _timed(0, warmup, one)
        counters = _RouterCounters(h)
        rows[label] = {"first_item_ms": p50(await _timed(calls, 0, one)), **counters.row(calls)}

    async def plain_rows(actor):
        async def call():
            t0 = time.perf_counter()
            await actor.ping.remote()
            return (time.perf_counter() - t0) * 1e3

        rows["actor call"] = {"first_item_ms": p50(await _timed(calls, warmup, call))}
        rows["actor stream"] = {"first_item_ms": p50(await _timed(calls, warmup, lambda: _first_item_ms(
            actor.stream.options(num_returns="streaming").remote(), resolve=True)))}

    async def protocol_rows(handle, label, by_reference=True):
        h = handle.options(stream=True, _by_reference=by_reference)
        sender = uuid.uuid4().hex
        outbox: asyncio.Queue = asyncio.Queue()

        async def read(replica):
            async for blob, load in h.outputs.remote(sender, replica=replica):
                now = time.perf_counter()
                for m in unpack_messages(blob):
                    outbox.put_nowait((now, m))

        reader = counters = None
        id_ms, out_ms, end_ms = [], [], []
        sent_at, received_at = {}, {}
        for i in range(calls + warmup):
            if i == warmup:
                counters = _RouterCounters(h)
            t0 = time.perf_counter()
            call = h.generate.remote(f"r{i}", PROMPT, params, block_hashes=None, sender=sender)
            async for replica in call:
                t_id = time.perf_counter()
                if reader is None:
                    reader = asyncio.create_task(read(replica))
            t_end = time.perf_counter()
            t_out = None
            while True:
                now, m = await outbox.get()
                if m[0] == "output" and m[1].request_id == f"r{i}":
                    t_out = t_out or now
                    if m[1].finished:
                        break
            if i >= warmup:
                id_ms.append((t_id - t0) * 1e3)
                out_ms.append((t_out - t0) * 1e3)
                end_ms.append((t_end - t0) * 1e3)
                sent_at[f"r{i}"], received_at[f"r{i}"] = t0, t_out
        reader.cancel()
        # perf_counter is the host's monotonic clock, the same in every process of the machine: the first
        # output's path splits into the call reaching the replica, the replica (engine), and the output's trip.
        hops = await handle.hop_times.remote()
        legs = [((hops[r][0] - sent_at[r]) * 1e3, (hops[r][1] - hops[r][0]) * 1e3, (received_at[r] - hops[r][1]) * 1e3)
                for r in sent_at]
        rows[label] = {"first_item_ms": p50(id_ms), "first_output_ms": p50(out_ms), "call_end_ms": p50(end_ms),
                       "to_replica_ms": p50([leg[0] for leg in legs]), "in_replica_ms": p50([leg[1] for leg in legs]),
                       "output_trip_ms": p50([leg[2] for leg in legs]), **counters.row(calls)}

    async def client_rows(handle, label):
        # As the ingress's app drives it: add_request and step() from a thread of their own (the app's engine
        # thread); the client's loop is a thread of its own, as in an ingress with Serve's router on its own loop.
        info = await handle.describe.remote()

        def drive() -> list[float]:
            client = RayEngineClient(handle, info, None, "prefix")
            ms = []
            try:
                for i in range(calls + warmup):
                    t0 = time.perf_counter()
                    client.add_request(f"c{i}", PROMPT, params)
                    first = None
                    while client.has_unfinished_requests():
                        for output in client.step(timeout_s=1.0):
                            if first is None and output.outputs[0].token_ids:
                                first = time.perf_counter()
                    if i >= warmup:
                        ms.append((first - t0) * 1e3)
            finally:
                client.shutdown()
            return ms

        rows[label] = {"first_output_ms": p50(await asyncio.to_thread(drive))}

    async def main():
        await plain_rows(Plain.remote())
        # No access-log line per call, as the engine deployment.
        echo = serve.deployment(Echo).options(name="Echo", ray_actor_options={"num_cpus": 0},
                                              logging_config={"enable_access_log": False},
                                              graceful_shutdown_timeout_s=1)  # its `outputs` stream never ends
        echo_handle = serve.run(echo.bind(), name="echo", route_prefix=None)
        await echo_rows(echo_handle, "echo stream")
        await protocol_rows(echo_handle, "echo replica")
        if GROUPS[name].get("RAY_SERVE_THROUGHPUT_OPTIMIZED") != "1":  # the preset uses gRPC already
            await protocol_rows(echo_handle, "echo replica, gRPC", by_reference=False)
        routed = echo.options(name="EchoRouted", request_router_config=pagedkv_router)
        await echo_rows(serve.run(routed.bind(), name="echo-routed", route_prefix=None), "echo, pagedkv rtr")
        for label, router in (("engine, pagedkv rtr", None), ("engine, default rtr", RequestRouterConfig())):
            deployment = engine_deployment(cfg, RayServeConfig()).options(
                func_or_class=TimedReplica, graceful_shutdown_timeout_s=1)  # delete at once: the next engine waits
            if router is not None:
                deployment = deployment.options(request_router_config=router)
            app = f"hops-{len(rows)}"
            handle = serve.run(deployment.bind(cfg, None), name=app, route_prefix=None)
            await protocol_rows(handle, label)
            if router is None and GROUPS[name].get("RAY_SERVE_THROUGHPUT_OPTIMIZED") != "1":
                await protocol_rows(handle, "engine, pagedkv, gRPC", by_reference=False)
            if router is None and GROUPS[name].get("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP") != "0" and \
                    name != "throughput":  # the client takes the caller's loop when the router shares it
                await client_rows(handle, "engine, RayEngineClient")
            serve.delete(app)  # one engine at a time on the box
        # On the loop: with Serve's router on the caller's loop (same-loop), handles are bound to it.
        await serve.shutdown_async()

    asyncio.run(main())
    ray.shutdown()
    return rows


def engine_alone_ms(cfg, params, calls: int, warmup: int) -> float:
    """First-token P50 of the same request on the engine in this process (no Ray)."""
    from pagedkv import LLM

    engine = LLM(**{k: getattr(cfg, k) for k in ("model", "device", "block_size", "num_blocks", "max_model_len")}).engine
    ttfts = []
    for i in range(calls + warmup):
        t0 = time.perf_counter()
        engine.add_request(f"e{i}", PROMPT, params)
        first = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter()
        if i >= warmup:
            ttfts.append((first - t0) * 1e3)
    return p50(ttfts)


def print_table(results: dict) -> None:
    cols = ("first_item_ms", "first_output_ms", "call_end_ms", "to_replica_ms", "in_replica_ms", "output_trip_ms",
            "probes_per_call", "choose_ms")
    print(f"{'group':<11} {'variant':<24}" + "".join(f"{c.removesuffix('_ms'):>16}" for c in cols))
    for group, rows in results.items():
        for variant, row in rows.items():
            print(f"{group:<11} {variant:<24}" + "".join(f"{row.get(c, ''):>16}" for c in cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("PAGEDKV_OUT", "out/ray_hops"))
    parser.add_argument("--group", help=argparse.SUPPRESS)  # a child: run this group, print its JSON last
    args = parser.parse_args()
    if args.group:
        print("RESULT " + json.dumps(run_group(args.group, args.calls, args.warmup)), flush=True)
        return
    results = {}
    for group in args.groups.split(","):
        child = subprocess.run([sys.executable, __file__, "--group", group, "--calls", str(args.calls),
                                "--warmup", str(args.warmup)],
                               env={**os.environ, "OMP_NUM_THREADS": "1", **GROUPS[group]},  # as the replicas
                               stdout=subprocess.PIPE, text=True)
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        results[group] = json.loads(lines[-1][7:]) if lines else {"failed": {"exit_code": child.returncode}}
    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_hops.json").write_text(json.dumps({"model": os.environ.get("MODEL", "random:tiny-llama"),
                                                   "calls": args.calls, "groups": results}, indent=1))
    print(f"wrote {out / 'ray_hops.json'}")


if __name__ == "__main__":
    main()
