"""The OpenAI-compatible server, over real uvicorn servers on 127.0.0.1 driven by `openai` and `httpx`.

SmolLM2 answers the completion and chat tests, which compare against `LLM.generate` on the
same engine config. A tiny random model (token-id prompts, `return_token_ids`) carries
disconnects, the API key and the failed-step test, because it is fast. The load test is
`test_server_load.py`; issue 14's robustness tests are `test_server_robustness.py`.
"""

import json
import random
import re
import time

import httpx
import openai
import pytest
from helpers import smollm2, tiny
from server_helpers import LiveServer, delta

from pagedkv import LLM, SamplingParams
from pagedkv.server import create_app
from pagedkv.cli import parse_memory
from pagedkv.server.cli import build_parser, engine_config
from pagedkv.server.serving import stable_text

SMOL_NAME = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CODE_PROMPT = "def add(a, b):"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # several full 16-token blocks


# ---------------------------------------------------------------------- SmolLM2: answers equal offline greedy

@pytest.fixture(scope="module")
def smol():
    """A served SmolLM2 engine, plus offline greedy references from `LLM.generate` on the same config."""
    model, tokenizer = smollm2()
    offline = LLM(hf_model=model, tokenizer=tokenizer, kv_cache_memory=64 * 2**20)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    code = offline.generate(CODE_PROMPT, greedy)[0]
    chat = offline.generate(offline.apply_chat_template(QUESTION), SamplingParams(temperature=0.0, max_tokens=32))[0]
    served = LLM(hf_model=model, tokenizer=tokenizer, kv_cache_memory=64 * 2**20)
    with LiveServer(create_app(served.engine, SMOL_NAME)) as server:
        server.refs = {"code": code, "chat": chat, "code_prompt_ids": tokenizer(CODE_PROMPT)["input_ids"],
                       "max_model_len": served.engine.max_model_len, "tokenizer": tokenizer}
        yield server


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_equals_offline_greedy(smol, client):
    ref = smol.refs["code"].outputs[0]
    out = client.completions.create(model=SMOL_NAME, prompt=CODE_PROMPT, max_tokens=16, temperature=0)
    assert out.object == "text_completion" and out.model == SMOL_NAME and out.id.startswith("cmpl-")
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(smol.refs["code_prompt_ids"])
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_token_ids_prompt_and_return_token_ids(smol):
    ref = smol.refs["code"].outputs[0]
    body = {"model": SMOL_NAME, "prompt": smol.refs["code_prompt_ids"], "max_tokens": 16, "temperature": 0,
            "return_token_ids": True}
    out = httpx.post(f"{smol.url}/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["token_ids"] == ref.token_ids
    assert out["choices"][0]["prompt_token_ids"] == smol.refs["code_prompt_ids"]
    assert out["choices"][0]["text"] == ref.text


def test_completion_stream_equals_offline_greedy(smol, client):
    ref = smol.refs["code"].outputs[0]
    chunks = list(client.completions.create(model=SMOL_NAME, prompt=CODE_PROMPT, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_chat_answers_and_equals_offline_greedy(smol, client):
    ref = smol.refs["chat"].outputs[0]
    out = client.chat.completions.create(model=SMOL_NAME, messages=QUESTION, temperature=0, max_tokens=32)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.content.strip() == "The capital of France is Paris."
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(ref.token_ids)
    # max_completion_tokens and the context-filling default give the same answer (it stops at EOS)
    out = client.chat.completions.create(model=SMOL_NAME, messages=QUESTION, temperature=0,
                                         max_completion_tokens=32)
    assert out.choices[0].message.content == ref.text
    out = client.chat.completions.create(model=SMOL_NAME, messages=QUESTION, temperature=0)
    assert out.choices[0].message.content == ref.text


def test_chat_stream(smol, client):
    ref = smol.refs["chat"].outputs[0]
    chunks = list(client.chat.completions.create(model=SMOL_NAME, messages=QUESTION, temperature=0, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stream_stop_string_is_never_streamed(smol, client):
    """A stop string split over tokens is held back, then cut: the stream equals the non-streamed text."""
    kwargs = {"model": SMOL_NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 32, "stop": ["Paris"]}
    full = client.chat.completions.create(**kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert full.choices[0].message.content == streamed == "The capital of France is "
    assert full.choices[0].finish_reason == "stop"


def test_sse_frames(smol):
    body = {"model": SMOL_NAME, "prompt": CODE_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{smol.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(frame.startswith("data: {") for frame in frames[:-2])
    assert all("usage" not in json.loads(frame[6:]) for frame in frames[:-2])


def test_models_and_health(smol, client):
    models = client.models.list().data
    assert [m.id for m in models] == [SMOL_NAME]
    assert httpx.get(f"{smol.url}/health").status_code == 200


def _bad_input_cases(max_model_len: int):
    yield "too long", "/v1/completions", {"prompt": "Hello there", "max_tokens": 2000}, [
        r"prompt \(\d+ tokens\) \+ max_tokens \(2000\)", f"max_model_len {max_model_len}"], "context_length_exceeded"
    yield "chat too long", "/v1/chat/completions", {"messages": QUESTION, "max_completion_tokens": 5000}, [
        r"max_tokens \(5000\)", f"max_model_len {max_model_len}"], "context_length_exceeded"
    yield "temperature", "/v1/completions", {"prompt": "Hi", "temperature": -1}, ["'temperature'", ">= 0"], None
    yield "top_p", "/v1/completions", {"prompt": "Hi", "top_p": 0}, ["'top_p'"], None
    yield "n", "/v1/completions", {"prompt": "Hi", "n": 0}, ["'n'"], None
    yield "max_tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, ["'max_tokens'"], None
    yield "max_completion_tokens", "/v1/chat/completions", {"messages": QUESTION, "max_completion_tokens": -3}, [
        "'max_completion_tokens'"], None
    yield "stop", "/v1/completions", {"prompt": "Hi", "stop": [""]}, ["'stop'"], None
    yield "empty prompt", "/v1/completions", {"prompt": ""}, ["prompt is empty"], None
    yield "empty token list", "/v1/completions", {"prompt": []}, ["prompt is empty"], None
    yield "empty messages", "/v1/chat/completions", {"messages": []}, ["messages is empty"], None
    yield "vocab", "/v1/completions", {"prompt": [1, 10**7]}, ["outside the vocabulary"], None
    yield "type (was 422)", "/v1/completions", {"prompt": "Hi", "temperature": "hot"}, [
        "'temperature'", "valid number"], None
    yield "bool is not an int (was 422)", "/v1/completions", {"prompt": "Hi", "max_tokens": True}, [
        "'max_tokens'", "valid integer"], None
    yield "missing field (was 422)", "/v1/completions", {"max_tokens": 3}, ["Missing required field 'prompt'"], None
    yield "prompt shape (was 422)", "/v1/completions", {"prompt": [["a"], 3]}, ["Invalid 'prompt'"], None
    yield "unsupported", "/v1/completions", {"prompt": "Hi", "tools": [{"type": "function"}]}, [
        "'tools' is not supported"], None
    yield "image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, ["only text parts"], None


def test_bad_inputs_are_400_with_openai_error_bodies(smol):
    cases = list(_bad_input_cases(smol.refs["max_model_len"]))
    cases.append(("malformed JSON", "/v1/completions", '{"prompt": "Hi", "max_tokens": 4', ["Malformed JSON"],
                  "json_invalid"))
    cases.append(("not an object", "/v1/completions", "[1, 2]", ["must be a JSON object"], None))
    with httpx.Client(base_url=smol.url, timeout=60) as http:
        before = smol.metrics()
        for name, path, body, patterns, code in cases:
            content = body if isinstance(body, str) else json.dumps(body)
            response = http.post(path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error", name
            assert set(error) == {"message", "type", "param", "code"}, name
            for pattern in patterns:
                assert re.search(pattern, error["message"]), (name, error["message"])
            if code is not None:
                assert error["code"] == code, name
    assert delta(before, smol.metrics(), "pagedkv_prompt_tokens_total") == 0  # nothing was queued


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=SMOL_NAME, prompt="Hi", max_tokens=100_000)


def test_metrics_move_with_the_engine(smol, client):
    before = smol.metrics()
    out = client.completions.create(model=SMOL_NAME, prompt=LONG_PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = smol.metrics()
    assert out.usage.completion_tokens == 8
    assert delta(before, after, "pagedkv_generation_tokens_total") == 8
    assert delta(before, after, "pagedkv_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta(before, after, "pagedkv_e2e_request_latency_seconds_count") == 1
    assert delta(before, after, "pagedkv_time_to_first_token_seconds_count") == 1
    assert delta(before, after, "pagedkv_time_per_output_token_seconds_count") == 1
    assert delta(before, after, "pagedkv_request_success_total{finished_reason=length}") == 1
    assert delta(before, after, "pagedkv_prefix_cache_queries_total") > 0
    # the same prompt again: its full blocks come from the prefix cache
    client.completions.create(model=SMOL_NAME, prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    again = smol.metrics()
    assert delta(after, again, "pagedkv_prefix_cache_hits_total") > 0
    assert delta(after, again, "pagedkv_prefix_cache_hit_tokens_total") >= 16
    assert delta(after, again, "pagedkv_prompt_tokens_total") < out.usage.prompt_tokens
    assert again["pagedkv_kv_cache_usage"] == 0 and again["pagedkv_num_requests_running"] == 0
    stats = smol.on_engine(lambda engine: engine.stats())
    assert stats.num_used_blocks == 0
    assert again["pagedkv_kv_cache_total_blocks"] == stats.num_blocks


# ---------------------------------------------------------------------- tiny random model: batches, disconnects

def _tiny_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.choice((3, 8, 17, 33)))] for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_server():
    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=96, max_num_seqs=32,
              max_num_batched_tokens=128, watermark=0.0)
    with LiveServer(create_app(llm.engine, "tiny-llama")) as server:
        yield server


def test_batch_prompt_with_n(tiny_server):
    prompts = _tiny_prompts(2, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=256).generate(prompts, params)]
    body = {"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    out = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in out["choices"]] == [expected[0], expected[0], expected[1], expected[1]]
    assert out["usage"] == {"prompt_tokens": len(prompts[0]) + len(prompts[1]), "completion_tokens": 24,
                            "total_tokens": len(prompts[0]) + len(prompts[1]) + 24}


def test_disconnect_aborts_and_frees_blocks_at_once(tiny_server):
    before = tiny_server.metrics()
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        assert tiny_server.metrics()["pagedkv_kv_cache_used_blocks"] > 0
    after = tiny_server.wait_idle(timeout_s=10)
    assert delta(before, after, "pagedkv_generation_tokens_total") < 300  # aborted, not run to the end
    assert delta(before, after, "pagedkv_e2e_request_latency_seconds_count") == 0
    tiny_server.on_engine(lambda engine: engine.check_integrity())


def test_idle_engine_thread_sleeps(tiny_server):
    tiny_server.wait_idle()
    before = tiny_server.async_engine.num_iterations
    time.sleep(0.3)
    assert tiny_server.async_engine.num_iterations == before  # blocked on its queue, not spinning


# ---------------------------------------------------------------------- API key, engine death, CLI

def test_api_key_is_enforced_on_v1_only():
    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64)
    with LiveServer(create_app(llm.engine, "tiny-llama", api_key="sk-right")) as server:
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}):
            response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2)
        right = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-right", max_retries=0)
        assert right.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens
        assert [m.id for m in right.models.list().data] == ["tiny-llama"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_step_fails_its_request_and_the_server_stays_up(stream):
    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64)
    real_step, num_steps = llm.engine.step, [0]

    def failing_step():  # a few good steps, then one that breaks
        num_steps[0] += 1
        if num_steps[0] == 4:
            raise RuntimeError("injected step failure")
        return real_step()

    with LiveServer(create_app(llm.engine, "tiny-llama")) as server:
        llm.engine.step = failing_step  # the engine thread looks step() up on each iteration
        body = {"prompt": [5, 6], "max_tokens": 20, "ignore_eos": True, "stream": stream, "return_token_ids": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        if stream:  # headers went out with the first chunk: the error arrives as an event, then [DONE]
            frames = [f for f in response.text.split("\n\n") if f]
            assert response.status_code == 200 and frames[-1] == "data: [DONE]"
            error = json.loads(frames[-2][6:])["error"]
            assert len(frames) >= 3 and "injected step failure" in error["message"]
            assert error["type"] == "server_error"
        else:
            assert response.status_code == 500
            assert "injected step failure" in response.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
        assert response.status_code == 200
        server.on_engine(lambda engine: engine.check_integrity())
        assert server.wait_idle()["pagedkv_kv_cache_used_blocks"] == 0


def test_cli_defaults_and_engine_config():
    args = build_parser().parse_args([])
    assert (args.model, args.host, args.port, args.api_key) == (None, "127.0.0.1", 8000, None)
    args = build_parser().parse_args(["random:tiny-llama", "--block-size", "8", "--kv-cache-memory", "64MiB",
                                      "--max-model-len", "256", "--preemption-mode", "swap", "--swap-space", "1GiB",
                                      "--max-num-seqs", "8", "--watermark", "0.05"])
    config = engine_config(args)
    assert (config.model, config.block_size, config.kv_cache_memory, config.max_model_len) == (
        "random:tiny-llama", 8, 64 * 2**20, 256)
    assert (config.preemption_mode, config.swap_space, config.max_num_seqs, config.watermark) == (
        "swap", 2**30, 8, 0.05)
    assert parse_memory("0.5") == 0.5 and parse_memory("1000") == 1000 and parse_memory("2GB") == 2 * 10**9


def test_stable_text_holds_back_stop_prefixes_and_partial_characters():
    assert stable_text("The capital is Pa", ("Paris",)) == "The capital is "
    assert stable_text("The capital is P", ("Paris", "Rome")) == "The capital is "
    assert stable_text("abc\ufffd", ()) == "abc"
    assert stable_text("abc", ("xyz",)) == "abc"
