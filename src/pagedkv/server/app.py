"""The OpenAI-compatible HTTP app: `create_app(engine, served_model_name, api_key, config=ServerConfig(...))`.

Routes: POST /v1/completions, POST /v1/chat/completions (both also as server-sent events),
GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize, GET /version, GET /health
(503 once the engine loop has died or shutdown has begun), GET /metrics (Prometheus).

Around the routes, three pure ASGI layers (so streaming is untouched), outermost first: one
counts responses by status, one checks the API key, and one refuses a body over
`max_request_body_bytes` with a 413 before any of it is parsed.

A handler validates its request completely in the tokenizer thread (`validate.prepare_*`,
so tokenizing never blocks the event loop), submits it to the engine thread (`async_engine`)
and answers from the outputs (`serving`). Bad input is a 400 with OpenAI's error body,
naming the problem; FastAPI's own 422s are rewritten to the same 400. A valid request that
does not fit *now* waits in the engine's queue (up to `max_queue`, then 429); only one that
can never fit is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.client import EngineClient
from pagedkv.models.loader import EMBEDDED_NAME
from pagedkv.server import protocol, validate
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.loop_engine import LoopAsyncEngine, runs_on_this_loop
from pagedkv.server.config import ServerConfig
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from pagedkv.server.serving import ClientDisconnectedError, Job, collect, full_response, stream_events, submit, token_text_fn

DEFAULT_SERVED_MODEL_NAME = EMBEDDED_NAME


class _ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped, so no error message (which may quote the client's input) fails to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(status_code: int, body: dict, headers: dict[str, str] | None = None) -> _ErrorResponse:
    return _ErrorResponse(body, status_code=status_code, headers=headers)


class _ResponseMetricsMiddleware:
    """Counts every HTTP response by status (a handler that raises counts as the 500 it becomes)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope, receive, send):
        # NOTE: Prometheus scrapes are left out, as vLLM does, so reading the counters does not move them.
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        status = None

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self._metrics.observe_response(status)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if status is None:
                self._metrics.observe_response(500)
            raise


class _APIKeyMiddleware:
    """`Authorization: Bearer <key>` on protected paths; the scheme is case-insensitive (RFC 7235)."""

    def __init__(self, app, api_key: str, protected: tuple[str, ...], metrics: ServerMetrics):
        self.app = app
        self._key = api_key.encode()
        self._protected = protected
        self._metrics = metrics

    def _is_protected(self, path: str) -> bool:
        return any(path == prefix or path.startswith(prefix + "/") for prefix in self._protected)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._is_protected(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)):
                self._metrics.observe_rejection("invalid_api_key")
                response = _error_response(401, error_body(
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, before any of it is parsed or kept.

    A declared Content-Length over the limit is refused without keeping the body; a chunked
    body is buffered only up to the limit. The rest is read and dropped (up to `drain_bytes`),
    so the client reads the 413 instead of a connection reset in the middle of its upload.
    """

    def __init__(self, app, max_bytes: int, metrics: ServerMetrics):
        self.app = app
        self._max_bytes = max_bytes
        self._drain_bytes = max(64 * 2**20, 4 * max_bytes)
        self._metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self._max_bytes
        messages, num_bytes, more = [], 0, True
        while not too_large:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                more = False
                break  # the client went away; the app sees the disconnect
            num_bytes += len(message.get("body", b""))
            too_large = num_bytes > self._max_bytes
            more = message.get("more_body", False)
            if not more:
                break
        if too_large:
            # Drain only a body still arriving: after its last part, another receive() would wait for a disconnect.
            await self._drain(receive, num_bytes, messages, more)
            self._metrics.observe_rejection("request_too_large")
            response = _error_response(413, error_body(
                f"The request body is larger than this server's limit of {self._max_bytes} bytes "
                f"(max_request_body_bytes).", code="request_too_large"))
            await response(scope, receive, send)
            return

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive, num_bytes: int, messages: list, more: bool) -> None:
        messages.clear()  # nothing of an oversized body is kept
        while more and num_bytes <= self._drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            num_bytes += len(message.get("body", b""))
            more = message.get("more_body", False)


def _validation_error(error: RequestValidationError, content_type: str = "") -> APIError:
    """FastAPI's 422 as OpenAI's 400, naming the field (or the JSON problem, or a body sent as another type)."""
    errors = error.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first["msg"])
        where = first["loc"][1] if len(first["loc"]) > 1 else None
        at = f" at character {where}" if isinstance(where, int) else ""
        return APIError(400, f"Malformed JSON in the request body: {detail}{at}.", code="json_invalid")
    loc = [str(part) for part in first["loc"] if part != "body"]
    if not loc:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type and media_type != "application/json" and not media_type.endswith("+json"):
            return APIError(400, f"The request body must be JSON sent with Content-Type: application/json "
                                 f"(got Content-Type: {media_type}).")
        return APIError(400, f"The request body must be a JSON object ({first['msg']}).")
    field = loc[0]
    if first["type"] == "missing":
        return APIError(400, f"Missing required field '{'.'.join(loc)}'.", param=field)
    if field == "prompt":
        return APIError(400, "Invalid 'prompt': expected a string, a list of token ids, or a list of either.",
                        param=field)
    return APIError(400, f"Invalid value for '{'.'.join(loc)}': {first['msg']}.", param=field)


@dataclasses.dataclass(frozen=True)
class _Served:
    """What the route handlers of one app share."""

    engine: EngineClient
    async_engine: AsyncEngine
    metrics: ServerMetrics
    config: ServerConfig
    limits: validate.Limits
    served_model_name: str
    tokenizer_thread: ThreadPoolExecutor
    token_text: Callable[[int], str]
    created: int

    async def prepare(self, fn, body):
        """Run `fn(engine, body, limits)` in the tokenizer thread, counting a refusal."""
        call = functools.partial(fn, self.engine, body, self.limits)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, call)
        except APIError as error:
            self.metrics.observe_rejection(error.code or "invalid_request")
            raise

    def start(self, prefix: str, prompts: list[list[int]], params, arrival_s: float) -> Job:
        config = self.config
        try:
            return submit(self.async_engine, prefix, prompts, params, arrival_s, max_queue=config.max_queue,
                          retry_after_s=config.retry_after_s, timeout_s=config.request_timeout_s,
                          metrics=self.metrics)
        except APIError as error:
            self.metrics.observe_rejection(error.code or "invalid_request")
            raise

    async def respond(self, job: Job, body, request: Request, chat: bool):
        if body.stream:
            events = stream_events(job, request, self.served_model_name, chat, body.include_usage,
                                   bool(body.return_token_ids), self.token_text)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outputs = await collect(job, request)
        except ClientDisconnectedError:
            return Response(status_code=499)  # nobody reads this: the client has gone
        return full_response(job, outputs, self.served_model_name, chat, bool(body.return_token_ids),
                             self.token_text)


def create_app(engine: EngineClient, served_model_name: str = DEFAULT_SERVED_MODEL_NAME, api_key: str | None = None,
               *, config: ServerConfig | None = None,
               on_engine_dead: Callable[[BaseException], None] | None = None) -> FastAPI:
    """An OpenAI-compatible app over `engine`. The engine thread runs for the app's lifespan (none for an
    engine whose calls run on this loop: `LoopAsyncEngine`, see `pagedkv.server.loop_engine`).

    `api_key`, when given, overrides `config.api_key`. `on_engine_dead(error)` is called (on
    the engine thread) if the engine loop dies; `pagedkv serve` exits non-zero then.

    Every engine call happens on that thread (or that loop) from then on; do not drive `engine` elsewhere
    while the app runs (use `app.state.async_engine.call(fn)` to run `fn(engine)` there).
    """
    config = config or ServerConfig()
    if api_key is not None:
        config = dataclasses.replace(config, api_key=api_key)
    metrics = ServerMetrics()
    limits = validate.Limits(served_model_name, config.max_prompt_chars or validate.prompt_chars_bound(engine),
                             config.ignore_unknown_fields)
    # NOTE: one thread, as vLLM does: HF fast tokenizers are not safe to call from several at once.
    # An engine whose calls already run on this loop (the Ray ingress's client) needs no engine thread.
    front = LoopAsyncEngine if runs_on_this_loop(engine) else AsyncEngine
    served = _Served(engine, front(engine, metrics, on_dead=on_engine_dead), metrics, config, limits,
                     served_model_name, ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tokenizer"),
                     token_text_fn(engine.tokenizer), protocol.now())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(served.async_engine.stop)
            served.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedkv", summary="OpenAI-compatible server over a paged KV cache", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = served.async_engine
    app.state.metrics = metrics
    app.state.config = config
    app.state.limits = limits
    app.state.served_model_name = served_model_name
    app.add_middleware(_BodyLimitMiddleware, max_bytes=config.max_request_body_bytes, metrics=metrics)
    if config.api_key is not None:
        protected = ("/v1", "/tokenize", "/detokenize") + (("/metrics",) if config.protect_metrics else ())
        app.add_middleware(_APIKeyMiddleware, api_key=config.api_key, protected=protected, metrics=metrics)
    app.add_middleware(_ResponseMetricsMiddleware, metrics=metrics)
    _add_error_handlers(app, metrics)
    _add_service_routes(app, served)
    _add_api_routes(app, served)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error as an OpenAI error body; validation errors name the field, and count as refusals."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return _error_response(error.status_code, error.body, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        converted = _validation_error(error, request.headers.get("content-type", ""))
        metrics.observe_rejection(converted.code or "invalid_request")
        return _error_response(converted.status_code, converted.body)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return _error_response(error.status_code, error_body(str(error.detail), kind))


def _add_service_routes(app: FastAPI, served: _Served) -> None:
    """/health, /metrics, /version and the model list."""
    engine, async_engine, name = served.engine, served.async_engine, served.served_model_name

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine loop runs, 503 once it has died or shutdown has begun."""
        if async_engine.is_draining:
            return _error_response(503, error_body("the server is shutting down", "server_error",
                                                   code="shutting_down"))
        if async_engine.is_alive:
            replicas = engine.health()  # data-parallel replicas (None for one engine)
            if replicas is None:
                return JSONResponse({"status": "ok"})
            alive = sum(r["alive"] for r in replicas)
            status = "ok" if alive == len(replicas) else "degraded" if alive else "dead"
            return JSONResponse({"status": status, "replicas": replicas}, status_code=200 if alive else 503)
        reason = async_engine.error or "the engine loop is not running"
        return _error_response(503, error_body(f"engine loop is not running: {reason}", "server_error",
                                               code="engine_dead"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        from pagedkv import __version__

        return {"version": __version__}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [protocol.model_card(name, served.created, engine.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        if model_id != name:
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves {name!r}.",
                           param="model", code="model_not_found")
        return protocol.model_card(name, served.created, engine.max_model_len)


def _add_api_routes(app: FastAPI, served: _Served) -> None:
    """/tokenize, /detokenize and the OpenAI completions and chat completions."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        tokens = await served.prepare(validate.prepare_tokenize, body)
        return {"count": len(tokens), "max_model_len": served.engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return {"prompt": await served.prepare(validate.prepare_detokenize, body)}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        arrival_s = time.perf_counter()
        prompts, params = await served.prepare(validate.prepare_completion, body)
        return await served.respond(served.start("cmpl", prompts, params, arrival_s), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        arrival_s = time.perf_counter()
        token_ids, params = await served.prepare(validate.prepare_chat, body)
        return await served.respond(served.start("chatcmpl", [token_ids], params, arrival_s), body, request,
                                    chat=True)
