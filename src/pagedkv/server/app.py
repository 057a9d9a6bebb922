"""The OpenAI-compatible HTTP app: `create_app(engine, served_model_name, api_key)`.

Routes: POST /v1/completions, POST /v1/chat/completions (both also as server-sent events),
GET /v1/models, GET /health (503 once the engine loop has died), GET /metrics (Prometheus).

A handler validates its request completely (`validate`), submits it to the engine thread
(`async_engine`) and answers from the outputs (`serving`). Bad input is a 400 with OpenAI's
error body, naming the problem; FastAPI's own 422s are rewritten to the same 400. A valid
request that does not fit *now* waits in the engine's queue; only one that can never fit
is refused.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.engine import LLMEngine
from pagedkv.hf.models import EMBEDDED_NAME
from pagedkv.server import protocol, validate
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from pagedkv.server.serving import ClientDisconnectedError, Job, collect, full_response, stream_events, submit

DEFAULT_SERVED_MODEL_NAME = EMBEDDED_NAME
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _json_error(status_code: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status_code)


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
        validate.check_model(body.model, served_model_name)
        validate.check_supported(body)
        prompts = validate.completion_prompts(engine, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params = validate.sampling_params(body, max_tokens, "max_tokens")
        for token_ids in prompts:
            validate.check_fits(engine, token_ids, params.max_tokens, "prompt")
        return await _respond(submit(async_engine, "cmpl", prompts, params, arrival_s), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        arrival_s = time.perf_counter()
        validate.check_model(body.model, served_model_name)
        validate.check_supported(body)
        token_ids = validate.chat_prompt(engine, body.messages)
        if body.max_completion_tokens is not None:
            max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = body.max_tokens, "max_tokens"
        if max_tokens is None:  # OpenAI's chat default: whatever room the context leaves
            max_tokens = max(1, engine.max_model_len - len(token_ids))
        params = validate.sampling_params(body, max_tokens, param)
        validate.check_fits(engine, token_ids, params.max_tokens, "messages")
        return await _respond(submit(async_engine, "chatcmpl", [token_ids], params, arrival_s), body, request,
                              chat=True)

    async def _respond(job: Job, body, request: Request, chat: bool):
        if body.stream:
            events = stream_events(job, request, served_model_name, chat, body.include_usage,
                                   bool(body.return_token_ids))
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outputs = await collect(job, request)
        except ClientDisconnectedError:
            return Response(status_code=499)  # nobody reads this: the client has gone
        return full_response(job, outputs, served_model_name, chat, bool(body.return_token_ids))

    return app
