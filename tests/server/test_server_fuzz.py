"""The request fuzz through HTTP: concurrent clients, streams and plain responses, random disconnects.

Every response is a 200 or a 4xx naming the bad field, never a 5xx; afterwards /health is ok and
every KV block is back. Also: `n > 1` with `max_tokens = 1` (which once failed its whole step
with a 500) and a request the engine fails alone (a 500 for it, a 200 for its step-mates, and a
count in /metrics).
"""

import asyncio
import json
import random

import httpx
import pytest
from fuzz_requests import draw_requests, fuzz_seed, letters_tokenizer
from helpers import tiny
from server_helpers import LiveServer, delta

from pagedkv import LLM
from pagedkv.server import create_app

NUM_REQUESTS = 60
CONCURRENCY = 8


def _body(request, rng: random.Random) -> dict:
    """The OpenAI completions body of a drawn request (a bad field where drawing its params failed)."""
    body = {"model": "tiny", "prompt": request.prompt, "stream": rng.random() < 0.5}
    params = request.params
    if params is None:
        return {**body, rng.choice(["temperature", "top_p", "n", "max_tokens"]): -1}
    body.update(n=params.n, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                ignore_eos=params.ignore_eos, min_tokens=params.min_tokens,
                presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty)
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if params.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
    if params.seed is not None:
        body["seed"] = params.seed
    return body


async def _send(client: httpx.AsyncClient, url: str, body: dict, disconnect: bool) -> tuple[int, str]:
    """(status, what came back); a disconnecting client reads one event of a stream, then hangs up."""
    if not body.get("stream"):
        response = await client.post(url, json=body)
        return response.status_code, response.text
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return response.status_code, (await response.aread()).decode()
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if disconnect:
                    return 200, "disconnected"
        return 200, "\n".join(events)


def _check(status: int, text: str, body: dict, context: str) -> None:
    assert status < 500, f"{context}: {status} for {body}: {text[:500]}"
    if status != 200:
        error = json.loads(text)["error"]
        assert status == 400 and error["message"], f"{context}: {status} {error} for {body}"
        return
    if text == "disconnected":
        return
    if body.get("stream"):
        events = text.split("\n")
        assert events[-1] == "[DONE]", f"{context}: the stream did not end with [DONE]: {events[-3:]}"
        assert not any('"error"' in event for event in events), f"{context}: error event in {events}"
        return
    choices = json.loads(text)["choices"]
    assert sorted(c["index"] for c in choices) == list(range(body.get("n", 1))), f"{context}: {choices}"
    assert all(c["finish_reason"] in ("stop", "length") for c in choices), f"{context}: {choices}"


def test_fuzz_through_the_http_server():
    seed = fuzz_seed() * 1000 + 500
    context = f"server fuzz seed {seed} (replay: PAGEDKV_FUZZ_SEED={fuzz_seed()})"
    rng = random.Random(seed)
    llm = LLM(hf_model=tiny("tiny-llama"), tokenizer=letters_tokenizer(), block_size=4, num_blocks=48,
              max_num_seqs=12, max_num_batched_tokens=48, preemption_mode=rng.choice(["recompute", "swap"]),
              swap_space=2**20)
    requests = draw_requests(rng, NUM_REQUESTS, "http")
    bodies = [(_body(r, rng), rng.random() < 0.15) for r in requests]

    async def run(url):
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(body, disconnect):
                async with gate:
                    return await _send(client, url, body, disconnect)

            return await asyncio.gather(*(one(body, disconnect) for body, disconnect in bodies))

    with LiveServer(create_app(llm.engine, "tiny")) as server:
        results = asyncio.run(run(f"{server.url}/v1/completions"))
        for (status, text), (body, _) in zip(results, bodies):
            _check(status, text, body, context)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        idle = server.wait_idle()
        assert idle["pagedkv_kv_cache_used_blocks"] == 0
        assert idle.get("pagedkv_request_failures_total", 0) == 0
        server.on_engine(lambda engine: engine.check_integrity())


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_of_one_token_through_the_server_fail_nobody(stream):
    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64)
    with LiveServer(create_app(llm.engine, "tiny")) as server:
        url = f"{server.url}/v1/completions"
        bodies = [{"prompt": [5, 6, 7], "max_tokens": 1, "n": n, "temperature": 1.0, "stream": stream}
                  for n in (2, 3)] + [{"prompt": [8, 9], "max_tokens": 5, "ignore_eos": True, "stream": stream}]

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(_send(client, url, body, False) for body in bodies))

        for (status, text), body in zip(asyncio.run(run()), bodies):
            _check(status, text, body, "n > 1, max_tokens = 1")
        assert server.wait_idle()["pagedkv_kv_cache_used_blocks"] == 0


def test_a_request_the_engine_fails_alone_is_a_500_and_counted(monkeypatch):
    llm = LLM(hf_model=tiny("tiny-llama"), tokenizer=letters_tokenizer(), block_size=4, num_blocks=64)
    original = llm.engine.output_processor.text

    def text(request, seq):
        if request.prompt_token_ids[0] == 30:
            raise RuntimeError("injected detokenization failure")
        return original(request, seq)

    monkeypatch.setattr(llm.engine.output_processor, "text", text)
    with LiveServer(create_app(llm.engine, "tiny")) as server:
        before = server.metrics()
        url = f"{server.url}/v1/completions"
        bodies = [{"prompt": [30, 31], "max_tokens": 4, "ignore_eos": True},
                  {"prompt": [30, 31], "max_tokens": 4, "ignore_eos": True, "stream": True},
                  {"prompt": [8, 9], "max_tokens": 4, "ignore_eos": True}]

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(_send(client, url, body, False) for body in bodies))

        (plain, plain_text), (streamed, events), (fine, fine_text) = asyncio.run(run())
        assert plain == 500 and "injected detokenization failure" in plain_text
        assert streamed == 200 and '"error"' in events and events.endswith("[DONE]")
        assert fine == 200 and json.loads(fine_text)["choices"][0]["finish_reason"] == "length"
        after = server.wait_idle()
        assert delta(before, after, "pagedkv_request_failures_total") == 2
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
