"""`pagedkv serve --engine-process`: the engine in a process of its own answers as the in-process engine does."""

import json
import time

import httpx
import pytest
from server_helpers import LiveServer

from pagedkv import LLM, SamplingParams
from pagedkv.distributed.data_parallel import DataParallelEngine
from pagedkv.engine.config import EngineConfig
from pagedkv.server import create_app
from pagedkv.server.cli import build_parser

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 45))]
OPTIONS = dict(model="random:tiny-llama", device="cpu", block_size=4, num_blocks=256)


@pytest.mark.slow
def test_the_engine_process_streams_and_answers_like_the_engine():
    want = [o.outputs[0].token_ids for o in LLM(**OPTIONS).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    engine = DataParallelEngine(EngineConfig(**OPTIONS), 1)
    try:
        with LiveServer(create_app(engine, "tiny")) as server:
            url = f"{server.url}/v1/completions"
            for prompt, tokens in zip(PROMPTS, want):
                body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]
                assert plain["token_ids"] == tokens
                with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
                    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                streamed = [t for e in events[:-1] for t in (json.loads(e)["choices"][0].get("token_ids") or [])]
                assert streamed == tokens
            health = httpx.get(f"{server.url}/health", timeout=10).json()
            assert health["status"] == "ok" and len(health["replicas"]) == 1
            assert server.wait_idle()["pagedkv_kv_cache_used_blocks"] == 0
    finally:
        engine.shutdown()


def test_the_flag_is_accepted():
    assert build_parser().parse_args(["--engine-process"]).engine_process


def test_the_engine_runs_in_its_own_process_by_default_on_cuda_only():
    from pagedkv.engine.config import EngineConfig
    from pagedkv.server.cli import uses_engine_process

    parse = build_parser().parse_args
    assert parse([]).engine_process is None and parse(["--in-process"]).engine_process is False
    cuda, cpu = EngineConfig(device="cuda"), EngineConfig(device="cpu")
    assert uses_engine_process(None, cuda) and not uses_engine_process(None, cpu)
    assert not uses_engine_process(False, cuda) and uses_engine_process(True, cpu)


def test_blocks_an_abort_frees_between_steps_reach_the_pushed_stats():
    # The server's per-step metrics read the stats the engine process pushes; once it is idle it steps no more,
    # so the blocks an abort frees must still be pushed, or /metrics would show them in use for good.
    engine = DataParallelEngine(EngineConfig(**OPTIONS), 1)
    try:
        engine.add_request("long", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        deadline = time.monotonic() + 60
        while not engine.latest_stats().num_used_blocks and time.monotonic() < deadline:
            engine.step()  # until a push shows its blocks held (pushes come after steps, 50 ms apart at most)
        assert engine.latest_stats().num_used_blocks > 0
        engine.abort("long")
        while engine.latest_stats().num_used_blocks and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.02)
        assert engine.latest_stats().num_used_blocks == 0
    finally:
        engine.shutdown()
