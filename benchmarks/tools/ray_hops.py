"""Where a request's first token goes on the Ray path: the engine deployment's calls timed from a driver.

One request at a time (8 prompt tokens, 2 out) on the engine deployment alone (no ingress, no HTTP):
the time until its `generate` call yields the replica's id, until its first output arrives on the
`outputs` stream, and until the call ends; then the same request on the engine alone in this
process. The differences are what Ray's hops cost. Runs on a CPU with a tiny model as written
(about 90 s on 2 cores); on a GPU machine set MODEL and DEVICE.

    PYTHONPATH=src python benchmarks/tools/ray_hops.py
"""
import asyncio, os, statistics, time, uuid
import ray
from ray import serve
from pagedkv.deploy.ray_serve import RayServeConfig, engine_deployment
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.sampling_params import SamplingParams

ray.init(num_cpus=3, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ["PYTHONPATH"]}})
cfg = EngineConfig(model=os.environ.get("MODEL", "random:tiny-llama"), device=os.environ.get("DEVICE", "cpu"),
                   block_size=16, num_blocks=256, max_model_len=512)
app = engine_deployment(cfg, RayServeConfig()).bind(cfg, None)
handle = serve.run(app, name="hops", route_prefix=None)

async def main():
    h = handle.options(stream=True)
    sender = uuid.uuid4().hex
    first_item, first_out, total = [], [], []
    replica = None
    outbox: asyncio.Queue = asyncio.Queue()
    async def read(rep):
        async for messages, load in h.outputs.remote(sender, replica=rep):
            now = time.perf_counter()
            for m in messages:
                outbox.put_nowait((now, m))
    reader = None
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # the engine alone, for reference: describe() does not step; use the replica's own timing via outputs
    for i in range(40):
        t0 = time.perf_counter()
        call = h.generate.remote(f"r{i}", [5, 6, 7, 8, 9, 10, 11, 12], params, block_hashes=None, sender=sender)
        got_first = None
        async for rep in call:
            t1 = time.perf_counter()
            if reader is None:
                reader = asyncio.create_task(read(rep))
        t_end = time.perf_counter()
        # first output message of this request
        while True:
            now, m = await outbox.get()
            if m[0] == "output" and m[1].request_id == f"r{i}":
                if got_first is None:
                    got_first = now
                if m[1].finished:
                    break
        if i >= 5:
            first_item.append((t1 - t0) * 1e3); first_out.append((got_first - t0) * 1e3); total.append((t_end - t0) * 1e3)
    print(f"replica id item P50 {statistics.median(first_item):.2f} ms; first output on the stream P50 "
          f"{statistics.median(first_out):.2f} ms; generate call end P50 {statistics.median(total):.2f} ms")
    reader.cancel()

asyncio.run(main())
# The engine alone, same request
from pagedkv import LLM
llm = LLM(**{k: getattr(cfg, k) for k in ("model", "device", "block_size", "num_blocks", "max_model_len")})
eng = llm.engine
ttfts = []
for i in range(40):
    t0 = time.perf_counter()
    eng.add_request(f"e{i}", [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    first = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if first is None and o.outputs[0].token_ids:
                first = time.perf_counter()
    if i >= 5: ttfts.append((first - t0) * 1e3)
print(f"engine alone: first token P50 {statistics.median(ttfts):.2f} ms")
serve.shutdown(); ray.shutdown()
