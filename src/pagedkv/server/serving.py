"""From engine outputs to OpenAI responses: one JSON body, or server-sent events.

A `Job` is the engine requests behind one HTTP request (one per prompt of a batch), sharing
one `RequestStream`. Whoever stops reading a job aborts what is left of it: `collect` and
`stream_events` both do so in a `finally`, which also runs when Starlette cancels a streaming
response because its client went away. Both also poll `request.is_disconnected()` every
`DISCONNECT_POLL_S`, so a server that does not cancel on disconnect is covered too, and both
end a request that outlives its deadline (`ServerConfig.request_timeout_s`).

Streamed text is the engine's detokenized text, released only where later tokens cannot
change it (`stable_text`): a stop string split over tokens never reaches the client. Nothing
is sent before the first token: the chat role rides on each choice's first chunk, so a
client's time to first token measures generation, not the HTTP round trip.

Once a stream has started, an error cannot change its status code: it arrives as an error
event (OpenAI's error body), followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import EngineDeadError
from pagedkv.server import protocol, sse
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import APIError, error_body
from pagedkv.server.request_stream import RequestFailedError, RequestStream, ShuttingDownError
from pagedkv.server.sse import ChunkEncoder

DISCONNECT_POLL_S = 0.5


class ClientDisconnectedError(Exception):
    """The HTTP client went away before its request finished."""


class RequestTimeoutError(Exception):
    """The request outlived the server's per-request timeout."""


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
    metrics: ServerMetrics | None = None
    deadline_s: float | None = None  # perf_counter seconds
    timeout_s: float | None = None

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token, or None when the request asked for no logprobs."""
        return getattr(self.params, "logprobs", None)

    def prompt_index(self, request_id: str) -> int:
        """Which prompt of the batch an engine request id belongs to (ids end in -INDEX)."""
        return int(request_id.rsplit("-", 1)[1])

    def abort_unfinished(self, finished: set[str], reason: str) -> None:
        """Abort every engine request not in `finished`, counting them as aborted for `reason`."""
        unfinished = [request_id for request_id in self.request_ids if request_id not in finished]
        # NOTE: counted before the aborts, so whoever sees the blocks come back also sees the count.
        if self.metrics is not None:
            self.metrics.observe_abort(reason, len(unfinished))
        for request_id in unfinished:
            self.async_engine.abort(request_id)


def submit(async_engine: AsyncEngine, prefix: str, prompts: list[list[int]], params: SamplingParams,
           arrival_s: float, *, max_queue: int | None = None, retry_after_s: int = 1,
           timeout_s: float | None = None, metrics: ServerMetrics | None = None) -> Job:
    """Queue one engine request per prompt: a 429 if the queue is full, a 503 if shutting down or dead."""
    retry = {"Retry-After": str(retry_after_s)}
    num_waiting = async_engine.num_waiting
    # NOTE: an empty queue takes any batch, so a batch larger than max_queue is not refused forever.
    if max_queue is not None and num_waiting and num_waiting + len(prompts) > max_queue:
        raise APIError(429, f"The server is busy: {num_waiting} requests are waiting (max_queue {max_queue}); "
                            f"retry after {retry_after_s} s.", type_="server_error", code="queue_full",
                       headers=retry)
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    job = Job(response_id, protocol.now(), [f"{response_id}-{i}" for i in range(len(prompts))], prompts, params,
              RequestStream(asyncio.get_running_loop()), async_engine, metrics,
              arrival_s + timeout_s if timeout_s is not None else None, timeout_s)
    added: list[str] = []
    try:
        for request_id, token_ids in zip(job.request_ids, prompts):
            async_engine.add_request(request_id, token_ids, params, job.stream, arrival_s)
            added.append(request_id)
    except ShuttingDownError as error:
        for request_id in added:
            async_engine.abort(request_id)
        raise APIError(503, str(error), type_="server_error", code="shutting_down", headers=retry) from None
    except EngineDeadError as error:
        raise APIError(503, str(error), type_="server_error", code="engine_dead") from None
    return job


class OutputReader:
    """Awaits a job's outputs, checking every `DISCONNECT_POLL_S` whether the client is still there."""

    def __init__(self, job: Job, request: Request):
        self._job = job
        self._request = request
        self._loop = asyncio.get_running_loop()
        self._next_check = self._loop.time() + DISCONNECT_POLL_S  # the loop's clock

    async def next(self) -> RequestOutput:
        """The next output; raises `ClientDisconnectedError`, `RequestTimeoutError`, or the stream's error."""
        deadline = self._job.deadline_s
        while True:
            now = self._loop.time()
            if now >= self._next_check:
                self._next_check = now + DISCONNECT_POLL_S
                if await self._request.is_disconnected():
                    raise ClientDisconnectedError
            wake_at = self._next_check
            if deadline is not None:
                left_s = deadline - time.perf_counter()
                if left_s <= 0:
                    raise RequestTimeoutError
                wake_at = min(wake_at, now + left_s)
            try:
                return await self._job.stream.get_until(wake_at)
            except TimeoutError:
                continue


def _as_api_error(error: Exception, job: Job) -> APIError:
    """The HTTP error a failed job answers with."""
    if isinstance(error, RequestFailedError):
        kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
        return APIError(error.status_code, str(error), type_=kind, code=error.code)
    if isinstance(error, ShuttingDownError):
        return APIError(503, str(error), type_="server_error", code="shutting_down")
    if isinstance(error, EngineDeadError):
        return APIError(500, str(error), type_="server_error", code="engine_dead")
    assert isinstance(error, RequestTimeoutError), error
    return APIError(504, f"The request did not finish within the server's timeout of {job.timeout_s:g} s.",
                    type_="server_error", code="timeout")


def _end_reason(error: Exception, finished: set[str], job: Job) -> str:
    """Why the job's unfinished requests are aborted; requests the engine thread already failed count as finished."""
    if isinstance(error, RequestTimeoutError):
        return "timeout"
    if isinstance(error, EngineDeadError):
        finished.update(job.request_ids)  # the engine thread failed (and counted) them all
        return "shutdown" if isinstance(error, ShuttingDownError) else "error"
    if isinstance(error, RequestFailedError):
        if error.request_id is not None:
            finished.add(error.request_id)
        return "error"
    return "client_disconnected"


def _rejected_error(output: RequestOutput) -> APIError:
    return APIError(400, f"This request can never be served: {output.error}", code="context_length_exceeded")


async def collect(job: Job, request: Request) -> list[RequestOutput]:
    """Every prompt's final output, in prompt order. Aborts what is left if the client goes away."""
    final: dict[str, RequestOutput] = {}
    failed: set[str] = set()  # ended by the engine thread, which aborted them itself
    reader = OutputReader(job, request)
    reason = "client_disconnected"  # also when Starlette cancels the handler
    try:
        while len(final) < len(job.request_ids):
            try:
                output = await reader.next()
            except (RequestFailedError, EngineDeadError, RequestTimeoutError) as error:
                reason = _end_reason(error, failed, job)
                raise _as_api_error(error, job) from None
            if output.finished:
                final[output.request_id] = output
    finally:
        job.abort_unfinished(set(final) | failed, reason)
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


class TokenIdText:
    """`token_id:N`, how a token of a model without a tokenizer shows in logprobs (as vLLM does).

    Such a model's completion text is empty, so its tokens add nothing to `text_offset`: the offsets
    are then the same however a stream's tokens were grouped into chunks.
    """

    adds_text = False

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def token_text_fn(tokenizer) -> Callable[[int], str]:
    """How a token shows in logprobs: its text, or `token_id:N` for a model without a tokenizer."""
    if tokenizer is None:
        return TokenIdText()
    return lambda token_id: tokenizer.decode([token_id])


def _logprobs(completion, start: int, end: int, chat: bool, token_text: Callable[[int], str],
              text_offset: int) -> dict | None:
    records = (getattr(completion, "logprobs", None) or [])[start:end]
    if chat:
        return protocol.chat_logprobs(records, token_text)
    return protocol.completion_logprobs(records, token_text, text_offset)


async def stream_events(job: Job, request: Request, model: str, chat: bool, include_usage: bool,
                        return_token_ids: bool, token_text: Callable[[int], str]) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per choice that moved, the usage chunk if asked, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    encoder = ChunkEncoder(kind, job.response_id, job.created, model, include_usage)
    n = job.params.n
    stops = job.params.stop
    wants_logprobs = job.num_logprobs is not None
    wants_tokens = return_token_ids or wants_logprobs
    prompt_index = {request_id: i for i, request_id in enumerate(job.request_ids)}
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    started: set[int] = set()  # choices whose first chunk (which carries the chat role) went out
    finished_choices: set[int] = set()
    finished: set[str] = set()
    num_completion_tokens = 0
    failure: APIError | None = None
    reason = "client_disconnected"  # also when Starlette cancels the response
    reader = OutputReader(job, request)
    try:
        while len(finished) < len(job.request_ids):
            try:
                output = await reader.next()
            except (RequestFailedError, EngineDeadError, RequestTimeoutError) as error:
                reason = _end_reason(error, finished, job)
                failure = _as_api_error(error, job)
                break
            except ClientDisconnectedError:
                return
            if output.error is not None:
                yield sse.event(_rejected_error(output).body)
                finished.add(output.request_id)
                continue
            base = prompt_index[output.request_id] * n
            for completion in output.outputs:
                index = base + completion.index
                if index in finished_choices:
                    continue
                is_done = completion.finish_reason is not None
                text = completion.text if is_done or not (stops or completion.text) else \
                    stable_text(completion.text, stops)
                offset = sent_chars.get(index, 0)
                delta = text[offset:]
                sent_chars[index] = max(len(text), offset)
                token_ids = completion.token_ids
                first_new = sent_tokens.get(index, 0)
                num_tokens = sent_tokens[index] = len(token_ids)
                if not (delta or is_done or (wants_tokens and num_tokens > first_new)):
                    continue
                new_tokens = token_ids[first_new:] if return_token_ids else None
                logprobs = _logprobs(completion, first_new, num_tokens, chat, token_text, offset) \
                    if wants_logprobs else None
                finish_reason = completion.finish_reason if is_done else None
                if is_done:
                    finished_choices.add(index)
                    num_completion_tokens += num_tokens
                if chat:
                    first = index not in started
                    yield encoder.chat(index, first, delta if delta or first else None, finish_reason, new_tokens,
                                       logprobs)
                else:
                    yield encoder.completion(index, delta, finish_reason, new_tokens, logprobs)
                started.add(index)
            if output.finished:
                finished.add(output.request_id)
        if failure is not None:
            yield sse.event(failure.body)
        elif include_usage:
            yield sse.event(protocol.response(kind, job.response_id, job.created, model, [],
                                              protocol.usage(sum(map(len, job.prompts)), num_completion_tokens)))
        yield sse.event("[DONE]")
    finally:
        # NOTE: runs on normal end, on a disconnect seen by polling, and when Starlette cancels the
        # response because the client went away (CancelledError / GeneratorExit): blocks free at once.
        job.abort_unfinished(finished, reason)


def full_response(job: Job, outputs: list[RequestOutput], model: str, chat: bool, return_token_ids: bool,
                  token_text: Callable[[int], str]) -> dict:
    """The non-streamed body: n choices per prompt, indexed prompt * n + sample, and usage."""
    choices = []
    num_completion_tokens = 0
    make = protocol.chat_choice if chat else protocol.completion_choice
    for prompt_index, output in enumerate(outputs):
        if output.error is not None:
            raise _rejected_error(output)
        for completion in sorted(output.outputs, key=lambda c: c.index):
            num_completion_tokens += len(completion.token_ids)
            logprobs = (_logprobs(completion, 0, len(completion.token_ids), chat, token_text, 0)
                        if job.num_logprobs is not None else None)
            choices.append(make(prompt_index * job.params.n + completion.index, completion.text,
                                completion.finish_reason, completion.token_ids if return_token_ids else None,
                                job.prompts[prompt_index] if return_token_ids else None, logprobs))
    kind = "chat.completion" if chat else "text_completion"
    return protocol.response(kind, job.response_id, job.created, model, choices,
                             protocol.usage(sum(map(len, job.prompts)), num_completion_tokens))
