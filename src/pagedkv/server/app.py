"""The OpenAI-compatible HTTP app: `create_app(engine, served_model_name, api_key)`.

Routes: POST /v1/completions, POST /v1/chat/completions (both also as server-sent events),
GET /v1/models, GET /health (503 once the engine loop has died), GET /metrics (Prometheus).

A request is validated completely in its handler, before anything is queued: the model
name, the prompt (tokenized, or the chat template applied), `SamplingParams`, and
`scheduler.check_fits`. Bad input is a 400 with OpenAI's error body, naming the problem;
FastAPI's own 422s are rewritten to the same 400. A valid request that does not fit *now*
waits in the engine's queue; only one that can never fit is refused.

A handler that stops listening aborts its engine requests: the streaming generator's
`finally` runs when Starlette cancels it on disconnect, and both paths also poll
`request.is_disconnected()` so that a server which does not cancel still notices.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling import SamplingParams
from pagedkv.errors import InvalidArgumentError, RequestRejectedError, SamplingParamsError
from pagedkv.hf.models import EMBEDDED_NAME
from pagedkv.server import protocol
from pagedkv.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest, error_body

logger = logging.getLogger("pagedkv.server")

DEFAULT_SERVED_MODEL_NAME = EMBEDDED_NAME
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code = status_code
        self.body = error_body(message, type_, param, code)


class ClientDisconnectedError(Exception):
    """The HTTP client went away before its request finished."""


def _json_error(status_code: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status_code)


# ---------------------------------------------------------------------- validation (handler thread)

def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(400, f"The model '{requested}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")


def _check_supported(body: protocol._SamplingFields) -> None:
    name = body.unsupported_field()
    if name is not None:
        raise APIError(400, f"'{name}' is not supported by this server (got {getattr(body, name)!r})", param=name)
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise APIError(400, f"'best_of' is not supported unless it equals n (got best_of={best_of}, n={body.n})",
                       param="best_of")
    for name in ("echo", "suffix"):
        if getattr(body, name, None):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)


def _tokenize(engine: LLMEngine, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, f"{param} is empty: at least one token is needed", param="prompt")
    try:
        _, token_ids = engine.tokenize(prompt)
    except InvalidArgumentError as error:
        raise APIError(400, f"{param}: {error}", param="prompt") from None
    if not token_ids:
        raise APIError(400, f"{param} is empty: at least one token is needed", param="prompt")
    return token_ids


def _completion_prompts(engine: LLMEngine, prompt) -> list[list[int]]:
    """Token ids of each prompt of a completion request (one prompt, or a batch)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [_tokenize(engine, prompt, "prompt")]
    return [_tokenize(engine, item, f"prompt[{i}]") for i, item in enumerate(prompt)]


def _chat_prompt(engine: LLMEngine, messages: list[protocol.ChatMessage]) -> list[int]:
    """Token ids of a conversation with the generation prompt appended (the tokenizer's chat template)."""
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it has no chat template: use /v1/completions "
                            "with token-id prompts", param="messages")
    if not messages:
        raise APIError(400, "messages is empty: at least one message is needed", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                        f"{part.get('type')!r}", param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        entry = message.model_dump(exclude_none=True)
        entry["content"] = content or ""
        conversation.append(entry)
    try:
        encoded = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    except Exception as error:  # noqa: BLE001 - templates raise whatever jinja raises
        raise APIError(400, f"could not apply the chat template: {error}", param="messages") from None
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)


def _sampling_params(body: protocol._SamplingFields, max_tokens: int | None, max_tokens_param: str) -> SamplingParams:
    options: dict = dict(n=body.n, ignore_eos=body.ignore_eos,
                         include_stop_str_in_output=body.include_stop_str_in_output)
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(body, name) is not None:
            options[name] = getattr(body, name)
    if body.stop is not None:
        options["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        options["stop_token_ids"] = tuple(body.stop_token_ids)
    try:
        return SamplingParams(**options)
    except SamplingParamsError as error:
        param = max_tokens_param if error.field == "max_tokens" else error.field
        reason = str(error).split(": ", 1)[-1]
        raise APIError(400, f"invalid '{param}': {reason}", param=param) from None


def _check_fits(engine: LLMEngine, token_ids: list[int], max_tokens: int, param: str) -> None:
    # NOTE: check_fits only reads the scheduler's frozen config, so it is safe off the engine thread.
    try:
        engine.scheduler.check_fits(len(token_ids), max_tokens)
    except RequestRejectedError as error:
        raise APIError(400, f"This request can never be served: {error}.", param=param,
                       code="context_length_exceeded") from None


# ---------------------------------------------------------------------- one HTTP request's engine requests

@dataclass
class _Job:
    """The engine requests behind one HTTP request (one per prompt), sharing one output stream."""

    response_id: str
    created: int
    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    stream: RequestStream
    async_engine: AsyncEngine

    def prompt_index(self, request_id: str) -> int:
        return int(request_id.rsplit("-", 1)[1])

    def abort_unfinished(self, finished: set[str]) -> None:
        for request_id in self.request_ids:
            if request_id not in finished:
                self.async_engine.abort(request_id)


def _submit(async_engine: AsyncEngine, prefix: str, prompts: list[list[int]], params: SamplingParams,
            arrival_s: float) -> _Job:
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    job = _Job(response_id, protocol.now(), [f"{response_id}-{i}" for i in range(len(prompts))], prompts, params,
               RequestStream(asyncio.get_running_loop()), async_engine)
    try:
        for request_id, token_ids in zip(job.request_ids, prompts):
            async_engine.add_request(request_id, token_ids, params, job.stream, arrival_s)
    except EngineDeadError as error:
        raise APIError(503, str(error), type_="server_error", code="engine_dead") from None
    return job


class _OutputReader:
    """Awaits a job's outputs, checking every `DISCONNECT_POLL_S` whether the client is still there."""

    def __init__(self, job: _Job, request: Request):
        self._job = job
        self._request = request
        self._last_check_s = time.monotonic()

    async def next(self) -> RequestOutput:
        while True:
            now = time.monotonic()
            if now - self._last_check_s >= DISCONNECT_POLL_S:
                self._last_check_s = now
                if await self._request.is_disconnected():
                    raise ClientDisconnectedError
            try:
                return await self._job.stream.get(DISCONNECT_POLL_S)
            except TimeoutError:
                continue


def _finish_reason(output: RequestOutput, reason: str | None) -> str | None:
    if output.error is not None:
        raise APIError(400, f"This request can never be served: {output.error}", code="context_length_exceeded")
    return reason


async def _collect(job: _Job, request: Request) -> list[RequestOutput]:
    """Every prompt's final output, in prompt order. Aborts what is left if the client goes away."""
    final: dict[str, RequestOutput] = {}
    reader = _OutputReader(job, request)
    try:
        while len(final) < len(job.request_ids):
            try:
                output = await reader.next()
            except EngineDeadError as error:
                raise APIError(500, str(error), type_="server_error", code="engine_dead") from None
            if output.finished:
                final[output.request_id] = output
    finally:
        job.abort_unfinished(set(final))
    return [final[request_id] for request_id in job.request_ids]


def _stable_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a still-growing text that later tokens cannot change.

    Holds back a trailing replacement character (an incomplete UTF-8 sequence so far) and
    the longest tail that could be the start of a stop string (which would be cut away).
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, end), held, -1):
            if text.endswith(stop[:size], 0, end):
                held = size
                break
    return text[:end - held]


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _stream(job: _Job, request: Request, model: str, chat: bool, include_usage: bool,
                  return_token_ids: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice that moved, the usage chunk if asked, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    n = job.params.n
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished_choices: set[int] = set()
    finished: set[str] = set()
    num_completion_tokens = 0
    reader = _OutputReader(job, request)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        return _sse(protocol.response(kind, job.response_id, job.created, model, choices, usage,
                                      with_usage_key=include_usage))

    try:
        if chat:
            for index in range(len(job.prompts) * n):
                yield chunk([protocol.chat_delta_choice(index, {"role": "assistant", "content": ""}, None)])
        while len(finished) < len(job.request_ids):
            try:
                output = await reader.next()
            except EngineDeadError as error:
                yield _sse(error_body(str(error), "server_error", code="engine_dead"))
                break
            if output.error is not None:
                yield _sse(error_body(f"This request can never be served: {output.error}",
                                      code="context_length_exceeded"))
                finished.add(output.request_id)
                continue
            base = job.prompt_index(output.request_id) * n
            for completion in output.outputs:
                index = base + completion.index
                if index in finished_choices:
                    continue
                is_done = completion.finish_reason is not None
                text = completion.text if is_done else _stable_text(completion.text, job.params.stop)
                delta = text[sent_chars.get(index, 0):]
                sent_chars[index] = max(len(text), sent_chars.get(index, 0))
                new_tokens = completion.token_ids[sent_tokens.get(index, 0):]
                sent_tokens[index] = len(completion.token_ids)
                if not (delta or is_done or (return_token_ids and new_tokens)):
                    continue
                token_ids = new_tokens if return_token_ids else None
                reason = completion.finish_reason if is_done else None
                if is_done:
                    finished_choices.add(index)
                    num_completion_tokens += len(completion.token_ids)
                if chat:
                    yield chunk([protocol.chat_delta_choice(index, {"content": delta} if delta else {}, reason,
                                                            token_ids)])
                else:
                    yield chunk([protocol.completion_choice(index, delta, reason, token_ids)])
            if output.finished:
                finished.add(output.request_id)
        else:
            if include_usage:
                yield chunk([], protocol.usage(sum(map(len, job.prompts)), num_completion_tokens))
        yield _sse("[DONE]")
    except ClientDisconnectedError:
        return
    finally:
        # NOTE: runs on normal end, on a disconnect seen by polling, and when Starlette cancels the
        # response because the client went away (CancelledError / GeneratorExit): blocks free at once.
        job.abort_unfinished(finished)


def _full_response(job: _Job, outputs: list[RequestOutput], model: str, chat: bool,
                   return_token_ids: bool) -> dict:
    choices = []
    num_completion_tokens = 0
    make = protocol.chat_choice if chat else protocol.completion_choice
    for prompt_index, output in enumerate(outputs):
        for completion in sorted(output.outputs, key=lambda c: c.index):
            reason = _finish_reason(output, completion.finish_reason)
            num_completion_tokens += len(completion.token_ids)
            choices.append(make(prompt_index * job.params.n + completion.index, completion.text, reason,
                                completion.token_ids if return_token_ids else None,
                                job.prompts[prompt_index] if return_token_ids else None))
    kind = "chat.completion" if chat else "text_completion"
    return protocol.response(kind, job.response_id, job.created, model, choices,
                             protocol.usage(sum(map(len, job.prompts)), num_completion_tokens))


# ---------------------------------------------------------------------- the app

class _APIKeyMiddleware:
    """Pure ASGI (so streaming is untouched): every /v1 route needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = _json_error(401, error_body(
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'.", param=None,
                    code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(error: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400, naming the field (or the JSON problem)."""
    errors = error.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first["msg"])
        where = first["loc"][1] if len(first["loc"]) > 1 else None
        at = f" at character {where}" if isinstance(where, int) else ""
        return APIError(400, f"Malformed JSON in the request body: {detail}{at}.", code="json_invalid")
    loc = [str(part) for part in first["loc"] if part != "body"]
    if not loc:
        return APIError(400, f"The request body must be a JSON object ({first['msg']}).")
    field = loc[0]
    if first["type"] == "missing":
        return APIError(400, f"Missing required field '{'.'.join(loc)}'.", param=field)
    if field == "prompt":
        return APIError(400, "Invalid 'prompt': expected a string, a list of token ids, or a list of either.",
                        param=field)
    return APIError(400, f"Invalid value for '{'.'.join(loc)}': {first['msg']}.", param=field)


def create_app(engine: LLMEngine, served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
               api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over `engine`. The engine thread runs for the app's lifespan.

    Every engine call happens on that thread from then on; do not drive `engine` elsewhere
    while the app runs (use `app.state.async_engine.call(fn)` to run `fn(engine)` there).
    """
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, metrics)
    created = protocol.now()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="pagedkv", summary="OpenAI-compatible server over a paged KV cache", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return _json_error(error.status_code, error.body)

    @app.exception_handler(RequestValidationError)
    async def _request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        converted = _validation_error(error)
        return _json_error(converted.status_code, converted.body)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return _json_error(error.status_code, error_body(str(error.detail), kind))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine loop runs, 503 once it has died."""
        if async_engine.is_alive:
            return JSONResponse({"status": "ok"})
        reason = async_engine.error or "the engine loop is not running"
        return _json_error(503, error_body(f"engine loop is not running: {reason}", "server_error",
                                           code="engine_dead"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [protocol.model_card(served_model_name, created, engine.max_model_len)]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        arrival_s = time.perf_counter()
        _check_model(body.model, served_model_name)
        _check_supported(body)
        prompts = _completion_prompts(engine, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params = _sampling_params(body, max_tokens, "max_tokens")
        for token_ids in prompts:
            _check_fits(engine, token_ids, params.max_tokens, "prompt")
        return await _respond(_submit(async_engine, "cmpl", prompts, params, arrival_s), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        arrival_s = time.perf_counter()
        _check_model(body.model, served_model_name)
        _check_supported(body)
        token_ids = _chat_prompt(engine, body.messages)
        if body.max_completion_tokens is not None:
            max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = body.max_tokens, "max_tokens"
        if max_tokens is None:  # OpenAI's chat default: whatever room the context leaves
            max_tokens = max(1, engine.max_model_len - len(token_ids))
        params = _sampling_params(body, max_tokens, param)
        _check_fits(engine, token_ids, params.max_tokens, "messages")
        return await _respond(_submit(async_engine, "chatcmpl", [token_ids], params, arrival_s), body, request,
                              chat=True)

    async def _respond(job: _Job, body, request: Request, chat: bool):
        if body.stream:
            events = _stream(job, request, served_model_name, chat, body.include_usage, body.return_token_ids)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outputs = await _collect(job, request)
        except ClientDisconnectedError:
            return Response(status_code=499)  # nobody reads this: the client has gone
        return _full_response(job, outputs, served_model_name, chat, body.return_token_ids)

    return app
