"""Where a request's first token goes when the engine runs in a process of its own: pipe in, engine, pipe out.

One request at a time (PROMPT_LEN random token ids in, 2 out, greedy), P50 over --calls after --warmup:

    in process       LLMEngine in this process: add_request, then step() until the first token
    engine process   DataParallelEngine with one replica, what `pagedkv serve` runs on CUDA (and a Ray replica):
                     add_request, then step() until the first token; and that time in three legs, on the host's
                     monotonic clock (one clock for both processes): the request's trip into the child's engine
                     (pipe_in: parent's add_request to the child's), the child's engine (engine: its add_request
                     to the return of the step that gave the first token) and the output's trip back (pipe_out:
                     to the parent's step() returning it)

No server, no HTTP: what is left of the difference between the two is the process boundary.

    PYTHONPATH=src python benchmarks/tools/engine_process_hops.py [--out DIR]     # CPU, tiny model (~1 min)
    MODEL=random:qwen3-0.6b DEVICE=cuda PYTHONPATH=src python3 benchmarks/tools/engine_process_hops.py --out $OUT

Writes engine_process_hops.json to --out. Benchmarks never assert.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

from pagedkv.engine.engine import LLMEngine

HOPS_FILE_ENV = "PAGEDKV_HOPS_FILE"


class TimedEngine(LLMEngine):
    """LLMEngine noting when each request was added and when a step first returned a token of it (child side)."""

    def __init__(self, config):
        super().__init__(config)
        self._added: dict[str, float] = {}
        self._log = open(os.environ[HOPS_FILE_ENV], "a", buffering=1)  # noqa: SIM115 - lives as long as the engine

    def add_request(self, request_id, *args, **kwargs):
        self._added[request_id] = time.perf_counter()
        return super().add_request(request_id, *args, **kwargs)

    def step(self):
        outputs = super().step()
        now = time.perf_counter()
        for output in outputs:
            added = self._added.pop(output.request_id, None)
            if added is not None and output.outputs and output.outputs[0].token_ids:
                self._log.write(f"{output.request_id} {added} {now}\n")
            elif added is not None:
                self._added[output.request_id] = added
        return outputs


def p50(values) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def first_token_ms(engine, prompts, params, warmup: int, step_kwargs: dict) -> tuple[list[float], dict]:
    """Per request after `warmup`: ms from add_request to the first token; and each request's (sent, received)."""
    ms, times = [], {}
    for i, prompt in enumerate(prompts):
        request_id = f"r{i}"
        sent = time.perf_counter()
        engine.add_request(request_id, prompt, params)
        received = None
        while engine.has_unfinished_requests():
            for output in engine.step(**step_kwargs):
                if received is None and output.outputs and output.outputs[0].token_ids:
                    received = time.perf_counter()
        if i >= warmup:
            ms.append((received - sent) * 1e3)
            times[request_id] = (sent, received)
    return ms, times


def main() -> None:
    from pagedkv.distributed.data_parallel import DataParallelEngine
    from pagedkv.distributed.router import RouterConfig, RoutingPolicy
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("PAGEDKV_OUT", "out/engine_process_hops"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, device = os.environ.get("MODEL", "random:tiny-llama"), os.environ.get("DEVICE", "cpu")
    prompt_len = int(os.environ.get("PROMPT_LEN", "128"))
    config = EngineConfig(model=model, device=device, block_size=16, max_model_len=int(os.environ.get("MAX_MODEL_LEN", "512")),
                          **({"num_blocks": 512} if device == "cpu" else {"kv_cache_memory": 0.2}))
    import torch

    gen = torch.Generator().manual_seed(0)
    vocab = int(os.environ.get("VOCAB", "500"))
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(args.calls + args.warmup)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    result = {"model": model, "device": device, "prompt_len": prompt_len, "calls": args.calls,
              "commit": os.environ.get("PAGEDKV_COMMIT")}
    engine = LLMEngine(config)
    engine.stream_outputs = True  # every step's outputs, as the server (and the replica process) runs it
    in_process, _ = first_token_ms(engine, prompts, params, args.warmup, {})
    engine.shutdown()
    del engine
    result["in_process_ms"] = p50(in_process)

    hops_file = out / "child_hops.txt"
    hops_file.write_text("")
    os.environ[HOPS_FILE_ENV] = str(hops_file)
    dp = DataParallelEngine(config, 1, tokenizer=None, router_config=RouterConfig(RoutingPolicy.ROUND_ROBIN),
                            engine_factory=TimedEngine)
    try:
        proc_ms, times = first_token_ms(dp, prompts, params, args.warmup, {"timeout_s": 0.05})
    finally:
        dp.shutdown()
    child = {rid: (float(a), float(b)) for rid, a, b in (line.split() for line in hops_file.read_text().splitlines())}
    legs = [((child[r][0] - s) * 1e3, (child[r][1] - child[r][0]) * 1e3, (rcv - child[r][1]) * 1e3)
            for r, (s, rcv) in times.items() if r in child]
    result.update(engine_process_ms=p50(proc_ms), pipe_in_ms=p50([leg[0] for leg in legs]),
                  engine_ms=p50([leg[1] for leg in legs]), pipe_out_ms=p50([leg[2] for leg in legs]))
    result["process_cost_ms"] = round(result["engine_process_ms"] - result["in_process_ms"], 3)
    (out / "engine_process_hops.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
