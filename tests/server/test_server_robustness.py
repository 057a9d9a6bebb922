"""One bad request never takes the server down (issue 14), and the OpenAI surface around it.

Every test here failed against the server before issue 14's fixes. A tiny random llama with
SmolLM2's tokenizer carries the text-prompt tests (fast, with a real tokenizer and chat
template); the plain tiny llama (no tokenizer) carries token-id prompts.
"""

import asyncio
import json
import threading

import httpx
import pytest
from helpers import tiny
from server_helpers import LiveServer, delta, tiny_chat_model

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.server import ServerConfig, create_app

NAME = "tiny"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _tiny_llm(**options) -> LLM:
    settings = {"block_size": 4, "num_blocks": 96, "max_num_seqs": 8, "max_num_batched_tokens": 128, **options}
    return LLM(hf_model=tiny("tiny-llama"), **settings)


def _chat_llm(**options) -> LLM:
    model, tokenizer = tiny_chat_model()
    return LLM(hf_model=model, tokenizer=tokenizer, block_size=4, num_blocks=256, **options)


def _slow_steps(llm: LLM, seconds: float) -> None:
    """Make every engine step take at least `seconds`, so a long request is still running when the test acts."""
    real_step = llm.engine.step

    def step():
        threading.Event().wait(seconds)
        return real_step()

    llm.engine.step = step


@pytest.fixture(scope="module")
def tiny_server():
    """Token-id prompts only (no tokenizer); max_num_seqs 8."""
    with LiveServer(create_app(_tiny_llm().engine, NAME)) as server:
        yield server


@pytest.fixture(scope="module")
def chat_server():
    """A real tokenizer and chat template over random weights."""
    with LiveServer(create_app(_chat_llm().engine, NAME)) as server:
        yield server


def _post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json",
                                                                          **kwargs.pop("headers", {})},
                      timeout=kwargs.pop("timeout", 30), **kwargs)


def _sse_frames(text: str) -> list[str]:
    return [frame for frame in text.split("\n\n") if frame]


def _assert_healthy(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    ok = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert server.wait_idle()["pagedkv_kv_cache_used_blocks"] == 0


# ---------------------------------------------------------------------- defect 1: isolation

def test_a_request_that_fails_on_the_engine_thread_fails_alone():
    llm = _tiny_llm()
    real_add = llm.engine.add_request

    def add_request(request_id, prompt, params=None, priority=0):
        if list(prompt) == [9, 9, 9]:
            raise RuntimeError("injected failure for one request")
        return real_add(request_id, prompt, params, priority)

    llm.engine.add_request = add_request  # the engine thread looks it up on every add
    _slow_steps(llm, 0.01)  # the neighbour is still running when the bad request comes
    with LiveServer(create_app(llm.engine, NAME)) as server:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as neighbour:
            lines = neighbour.iter_lines()
            first = next(line for line in lines if line)
            bad = _post(server, "/v1/completions", {"prompt": [9, 9, 9], "max_tokens": 2})
            assert bad.status_code == 500
            assert "injected failure" in bad.json()["error"]["message"]
            assert bad.json()["error"]["type"] == "server_error"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and all("error" not in line for line in rest)
        assert sum(len(json.loads(line[6:])["choices"][0]["token_ids"]) for line in [first, *rest[:-1]]) == 40
        streamed = _post(server, "/v1/completions", {"prompt": [9, 9, 9], "max_tokens": 2, "stream": True})
        frames = _sse_frames(streamed.text)
        assert frames[-1] == "data: [DONE]" and "injected failure" in frames[-2]
        _assert_healthy(server)


def test_a_step_that_raises_fails_the_requests_in_it_and_the_loop_goes_on():
    llm = _tiny_llm()
    real_step, fail_next = llm.engine.step, threading.Event()

    def step():
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("injected step failure")
        return real_step()

    llm.engine.step = step
    with LiveServer(create_app(llm.engine, NAME)) as server:
        fail_next.set()
        failed = _post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
        assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
        _assert_healthy(server)
        server.on_engine(lambda engine: engine.check_integrity())
        assert server.metrics()["pagedkv_request_aborted_total{reason=error}"] == 1


def test_a_step_failure_that_names_its_request_fails_that_request_alone():
    llm = _tiny_llm()
    real_step, culprit = llm.engine.step, []

    class RequestStepError(RuntimeError):
        def __init__(self, request_id):
            super().__init__(f"request {request_id} broke the step")
            self.request_id = request_id

    def step():
        if culprit:
            raise RequestStepError(culprit.pop())
        return real_step()

    llm.engine.step = step
    _slow_steps(llm, 0.01)  # both requests are still running when the culprit is named
    with LiveServer(create_app(llm.engine, NAME)) as server:
        body = {"max_tokens": 40, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": [5, 6, 7, 8], **body},
                          timeout=30) as bystander, \
                httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": [9, 8, 7], **body},
                             timeout=30) as victim:
            bystander_lines, victim_lines = bystander.iter_lines(), victim.iter_lines()
            bystander_first = next(line for line in bystander_lines if line)
            first = next(line for line in victim_lines if line)
            culprit.append(json.loads(first[len("data: "):])["id"] + "-0")  # engine request ids: <response id>-<prompt>
            victim_rest = [line for line in victim_lines if line]
            bystander_rest = [line for line in bystander_lines if line]
        assert victim_rest[-1] == "data: [DONE]" and "broke the step" in victim_rest[-2]
        assert bystander_rest[-1] == "data: [DONE]" and all("error" not in line for line in bystander_rest)
        chunks = [bystander_first, *bystander_rest[:-1]]
        assert sum(len(json.loads(line[6:])["choices"][0]["token_ids"]) for line in chunks) == 40
        _assert_healthy(server)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_an_out_of_range_seed_never_takes_the_service_down(tiny_server, seed):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 1.0, "seed": seed}
    response = _post(tiny_server, "/v1/completions", body)
    # 400 once SamplingParams bounds the seed (branch `sampler`); until then the failed step fails it alone.
    assert response.status_code in (400, 500), response.text
    _assert_healthy(tiny_server)


def test_repeated_step_failures_end_the_loop_and_health_says_why():
    """A broken device fails every step: after a few in a row the loop stops for good (no silent zombie)."""
    llm = _tiny_llm()

    def step():
        raise RuntimeError("injected device failure")

    llm.engine.step = step
    dead = []
    with LiveServer(create_app(llm.engine, NAME, on_engine_dead=dead.append)) as server:
        for _ in range(10):
            response = _post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
            if response.status_code == 503:
                break
            assert response.status_code == 500, response.text
        assert response.status_code == 503
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "injected device failure" in health.json()["error"]["message"]
        assert len(dead) == 1 and "injected device failure" in str(dead[0])


def test_serve_exits_non_zero_when_the_engine_loop_dies():
    from pagedkv.server.cli import bind, serve

    llm = _tiny_llm()

    def broken_stats():
        raise RuntimeError("injected loop failure")

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = create_app(llm.engine, NAME)
    result = []
    thread = threading.Thread(target=lambda: result.append(serve(app, sock, shutdown_timeout_s=1,
                                                                 log_level="critical")))
    thread.start()
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            threading.Event().wait(0.05)
        llm.engine.stats = broken_stats  # the loop reads stats for the metrics after every step
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
    finally:
        thread.join(30)
    assert result == [1]


# ---------------------------------------------------------------------- defect 2: size limits, tokenizer thread

def test_a_body_over_the_limit_is_413_before_parsing():
    llm = _tiny_llm()
    with LiveServer(create_app(llm.engine, NAME, config=ServerConfig(max_request_body_bytes=4096))) as server:
        big = json.dumps({"prompt": [5] * 5000, "max_tokens": 1})
        response = _post(server, "/v1/completions", big)
        assert response.status_code == 413
        error = response.json()["error"]
        assert "4096" in error["message"] and error["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit holds while the body streams in
            for start in range(0, len(big), 1000):
                yield big[start:start + 1000].encode()

        response = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                              headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 413
        assert server.metrics()["pagedkv_http_responses_total{status=413}"] == 2
        _assert_healthy(server)


def test_the_default_body_limit_refuses_a_10mb_prompt(tiny_server):
    response = _post(tiny_server, "/v1/completions", json.dumps({"prompt": "x" * 10_000_000}))
    assert response.status_code == 413


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing():
    llm = _chat_llm()
    real_tokenize, seen = llm.engine.tokenize, []

    def tokenize(prompt):
        seen.append(len(prompt))
        return real_tokenize(prompt)

    llm.engine.tokenize = tokenize
    with LiveServer(create_app(llm.engine, NAME)) as server:
        limit = server.app.state.limits.max_prompt_chars
        assert limit >= llm.engine.max_model_len  # never refuses what could fit
        response = _post(server, "/v1/completions", {"prompt": "y" * (limit + 1), "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert str(llm.engine.max_model_len) in response.json()["error"]["message"]
        response = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * (limit + 1)}]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert seen == []  # neither prompt reached the tokenizer


def test_tokenization_runs_off_the_event_loop():
    """While a tokenizer call is stuck, /health still answers: the event loop is free."""
    llm = _chat_llm()
    real_tokenize, entered, release = llm.engine.tokenize, threading.Event(), threading.Event()

    def tokenize(prompt):
        entered.set()
        release.wait(30)
        return real_tokenize(prompt)

    llm.engine.tokenize = tokenize
    with LiveServer(create_app(llm.engine, NAME)) as server:
        result = []
        client = threading.Thread(target=lambda: result.append(
            _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})))
        client.start()
        assert entered.wait(30)
        try:
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        finally:
            release.set()
            client.join(30)
        assert result[0].status_code == 200


# ---------------------------------------------------------------------- defects 3, 4, 8: validation

@pytest.mark.parametrize("stream", [False, True])
def test_n_above_max_num_seqs_is_a_400_naming_n(tiny_server, stream):
    response = _post(tiny_server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "n": 9, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "max_num_seqs" in error["message"] and "8" in error["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "ok", "model": "\ud800"}, "model"),
    ("/v1/completions", {"prompt": ["ok", "bad \udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": "ok", "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
])
def test_a_lone_surrogate_is_a_400(chat_server, path, body, param):
    response = _post(chat_server, path, json.dumps(body))  # json.dumps writes the surrogate as \ud800
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and "surrogate" in error["message"]


@pytest.mark.parametrize("message, param", [
    ({"role": "user"}, "messages[0].content"),
    ({"role": "user", "content": None}, "messages[0].content"),
    ({"role": "wizard", "content": "hi"}, "messages[0].role"),
])
def test_a_bad_chat_message_is_a_400(chat_server, message, param):
    response = _post(chat_server, "/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_unknown_field_is_a_400_naming_it(chat_server):
    response = _post(chat_server, "/v1/completions", {"prompt": "Hi", "max_token": 999})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_token" and "max_token" in error["message"]
    assert error["code"] == "unknown_field"


def test_unknown_fields_can_be_ignored():
    llm = _tiny_llm()
    with LiveServer(create_app(llm.engine, NAME, config=ServerConfig(ignore_unknown_fields=True))) as server:
        response = _post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "max_token": 999})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 2


# ---------------------------------------------------------------------- defect 7: auth

def test_an_empty_api_key_is_refused():
    with pytest.raises(ConfigError, match="empty"):
        create_app(_tiny_llm().engine, NAME, api_key="")


def test_bearer_is_case_insensitive_and_metrics_can_be_protected():
    config = ServerConfig(api_key="sk-right", protect_metrics=True)
    with LiveServer(create_app(_tiny_llm().engine, NAME, config=config)) as server:
        for scheme in ("Bearer", "bearer", "BEARER"):
            response = _post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1},
                             headers={"Authorization": f"{scheme} sk-right"})
            assert response.status_code == 200, scheme
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer sk-right"}).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
        assert _post(server, "/tokenize", {"prompt": "x"}).status_code == 401


# ---------------------------------------------------------------------- endpoints

def test_tokenize_and_detokenize(chat_server):
    tokenizer = tiny_chat_model()[1]
    out = _post(chat_server, "/tokenize", {"prompt": "The capital of France"}).json()
    assert out["tokens"] == tokenizer("The capital of France")["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    chat = _post(chat_server, "/tokenize", {"messages": QUESTION}).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                                tokenize=True)["input_ids"])
    text = _post(chat_server, "/detokenize", {"tokens": out["tokens"]}).json()
    assert text == {"prompt": "The capital of France"}
    bad = _post(chat_server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_version_and_model_by_id(tiny_server):
    import pagedkv

    assert httpx.get(f"{tiny_server.url}/version").json() == {"version": pagedkv.__version__}
    card = httpx.get(f"{tiny_server.url}/v1/models/{NAME}").json()
    assert card["id"] == NAME and card["object"] == "model"
    missing = httpx.get(f"{tiny_server.url}/v1/models/gpt-5")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------------- backpressure and timeouts

def test_a_full_queue_is_a_429_with_retry_after():
    llm = _tiny_llm()
    real_step, gate = llm.engine.step, threading.Event()

    def step():  # nothing progresses until the test opens the gate
        gate.wait(30)
        return real_step()

    llm.engine.step = step
    with LiveServer(create_app(llm.engine, NAME, config=ServerConfig(max_queue=2))) as server:
        body = {"prompt": [5, 6], "max_tokens": 2, "stream": True}
        streams = [httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            refused = _post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
        finally:
            gate.set()
            for s in streams:
                s.__exit__(None, None, None)
        assert server.metrics()["pagedkv_request_rejected_total{reason=queue_full}"] == 1
        _assert_healthy(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_timeout_is_aborted(stream):
    llm = _tiny_llm()
    _slow_steps(llm, 0.05)  # 200 tokens cannot finish within the timeout
    config = ServerConfig(request_timeout_s=0.5)
    with LiveServer(create_app(llm.engine, NAME, config=config)) as server:
        body = {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "stream": stream}
        response = _post(server, "/v1/completions", body)
        if stream:
            frames = _sse_frames(response.text)
            assert frames[-1] == "data: [DONE]" and json.loads(frames[-2][6:])["error"]["code"] == "timeout"
        else:
            assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        after = server.wait_idle()
        assert after["pagedkv_request_aborted_total{reason=timeout}"] == 1


# ---------------------------------------------------------------------- metrics, TTFT

def test_disconnects_rejections_and_statuses_are_counted():
    llm = _tiny_llm()
    _slow_steps(llm, 0.01)
    with LiveServer(create_app(llm.engine, NAME)) as server:
        before = server.metrics()
        _post(server, "/v1/completions", {"prompt": [5], "temperature": -1})
        _post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2})
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 300, "ignore_eos": True, "stream": True,
                "return_token_ids": True}  # no tokenizer, so no text: token ids make every token a chunk
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            next(line for line in response.iter_lines() if line)
        after = server.wait_idle()
        assert delta(before, after, "pagedkv_http_responses_total{status=400}") == 1
        assert delta(before, after, "pagedkv_http_responses_total{status=200}") == 2
        assert delta(before, after, "pagedkv_request_rejected_total{reason=invalid_request}") == 1
        assert delta(before, after, "pagedkv_request_aborted_total{reason=client_disconnected}") == 1
        assert delta(before, after, "pagedkv_generation_tokens_total") < 300


def test_the_chat_stream_sends_nothing_before_the_first_token(chat_server):
    """Time to first token is honest: the role rides on the first chunk that carries a token."""
    body = {"messages": QUESTION, "max_tokens": 4, "stream": True, "ignore_eos": True}
    frames = _sse_frames(_post(chat_server, "/v1/chat/completions", body).text)
    chunks = [json.loads(frame[6:]) for frame in frames[:-1]]
    first = chunks[0]["choices"][0]
    assert first["delta"].get("role") == "assistant" and first["delta"].get("content")
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in chunks[1:])
