"""From engine outputs to OpenAI responses: one JSON body, or server-sent events.

A `Job` is the engine requests behind one HTTP request (one per prompt of a batch), sharing
one `RequestStream`. Whoever stops reading a job aborts what is left of it: `collect` and
`stream_events` both do so in a `finally`, which also runs when Starlette cancels a streaming
response because its client went away. Both also poll `request.is_disconnected()` every
`DISCONNECT_POLL_S`, so a server that does not cancel on disconnect is covered too.

Streamed text is the engine's detokenized text, released only where later tokens cannot
change it (`stable_text`): a stop string split over tokens never reaches the client.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling import SamplingParams
from pagedkv.server import protocol
from pagedkv.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from pagedkv.server.protocol import APIError, error_body

DISCONNECT_POLL_S = 0.5


class ClientDisconnectedError(Exception):
    """The HTTP client went away before its request finished."""



@dataclass
class Job:
    """The engine requests behind one HTTP request (one per prompt), sharing one output stream."""

    response_id: str
    created: int
    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    stream: RequestStream
    async_engine: AsyncEngine

    def prompt_index(self, request_id: str) -> int:
        """Which prompt of the batch an engine request id belongs to (ids end in -INDEX)."""
        return int(request_id.rsplit("-", 1)[1])

    def abort_unfinished(self, finished: set[str]) -> None:
        """Abort every engine request not in `finished` (aborting a finished one is harmless anyway)."""
        for request_id in self.request_ids:
            if request_id not in finished:
                self.async_engine.abort(request_id)


def submit(async_engine: AsyncEngine, prefix: str, prompts: list[list[int]], params: SamplingParams,
           arrival_s: float) -> Job:
    """Queue one engine request per prompt; a 503 if the engine loop has died."""
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    job = Job(response_id, protocol.now(), [f"{response_id}-{i}" for i in range(len(prompts))], prompts, params,
              RequestStream(asyncio.get_running_loop()), async_engine)
    try:
        for request_id, token_ids in zip(job.request_ids, prompts):
            async_engine.add_request(request_id, token_ids, params, job.stream, arrival_s)
    except EngineDeadError as error:
        raise APIError(503, str(error), type_="server_error", code="engine_dead") from None
    return job


class OutputReader:
    """Awaits a job's outputs, checking every `DISCONNECT_POLL_S` whether the client is still there."""

    def __init__(self, job: Job, request: Request):
        self._job = job
        self._request = request
        self._last_check_s = time.monotonic()

    async def next(self) -> RequestOutput:
        """The next output; raises `ClientDisconnectedError`, or `EngineDeadError` from the stream."""
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


async def collect(job: Job, request: Request) -> list[RequestOutput]:
    """Every prompt's final output, in prompt order. Aborts what is left if the client goes away."""
    final: dict[str, RequestOutput] = {}
    reader = OutputReader(job, request)
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


def stable_text(text: str, stops: tuple[str, ...]) -> str:
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


async def stream_events(job: Job, request: Request, model: str, chat: bool, include_usage: bool,
                        return_token_ids: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice that moved, the usage chunk if asked, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    n = job.params.n
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished_choices: set[int] = set()
    finished: set[str] = set()
    num_completion_tokens = 0
    engine_error: EngineDeadError | None = None
    reader = OutputReader(job, request)

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
                engine_error = error
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
                text = completion.text if is_done else stable_text(completion.text, job.params.stop)
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
        if engine_error is not None:
            yield _sse(error_body(str(engine_error), "server_error", code="engine_dead"))
        elif include_usage:
            yield chunk([], protocol.usage(sum(map(len, job.prompts)), num_completion_tokens))
        yield _sse("[DONE]")
    except ClientDisconnectedError:
        return
    finally:
        # NOTE: runs on normal end, on a disconnect seen by polling, and when Starlette cancels the
        # response because the client went away (CancelledError / GeneratorExit): blocks free at once.
        job.abort_unfinished(finished)


def full_response(job: Job, outputs: list[RequestOutput], model: str, chat: bool, return_token_ids: bool) -> dict:
    """The non-streamed body: n choices per prompt, indexed prompt * n + sample, and usage."""
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
