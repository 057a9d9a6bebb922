"""The HTTP side of `bench serve`: one async httpx client that streams OpenAI completions and times them.

Connection limits are at least the run's concurrency, so requests never queue inside the
client. Each streamed chunk is timestamped as its line arrives, before it is parsed; the
parse time is recorded per request so the run can report what the client itself cost.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from pagedkv.bench.serve.datasets import BenchRequest
from pagedkv.bench.serve.metrics import RequestRecord
from pagedkv.errors import InvalidArgumentError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class OpenAIClient:
    """Streams requests to an OpenAI-compatible server and returns what it saw as `RequestRecord`s."""

    def __init__(self, base_url: str, endpoint: str = "completions", api_key: str | None = None,
                 max_connections: int = 256, timeout_s: float = 600.0, stream: bool = True,
                 ignore_eos: bool = False, temperature: float = 0.0):
        if endpoint not in ENDPOINTS:
            raise InvalidArgumentError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
        if max_connections < 1:
            raise InvalidArgumentError(f"max_connections must be >= 1, got {max_connections}")
        self.endpoint = endpoint
        self.stream = stream
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # NOTE: keep-alive as wide as the pool, or connections past it are closed and reopened under load.
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                                      timeout=httpx.Timeout(timeout_s, connect=30.0))

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def served_model(self) -> str:
        """The first model id /v1/models lists."""
        try:
            response = await self.http.get("/v1/models")
            response.raise_for_status()
        except httpx.HTTPError as error:
            raise InvalidArgumentError(f"cannot list models at {self.http.base_url}/v1/models ({error}); "
                                       f"is the server up? (or pass --model)") from None
        models = response.json().get("data") or []
        if not models:
            raise InvalidArgumentError(f"{self.http.base_url}/v1/models lists no model; pass --model")
        return models[0]["id"]

    async def accepts_token_ids(self, model: str) -> bool:
        """Whether /v1/completions takes a prompt given as a list of token ids (one 1-token request)."""
        body = {"model": model, "prompt": [200, 201, 202, 203], "max_tokens": 1, "temperature": 0.0}
        response = await self.http.post(ENDPOINTS["completions"], json=body)
        return response.status_code == 200

    async def returns_token_ids(self, model: str, prompt_format: str) -> bool:
        """Whether the endpoint honours `return_token_ids` (pagedkv's and vLLM's extra; one 1-token request).

        With it every streamed token shows up as an id, even when it decodes to no text yet (a
        partial character, a held-back stop string, or a model served without a tokenizer).
        """
        probe = BenchRequest((("user", (200, 201, 202, 203)),), 4, 1)
        body = {"model": model, **probe.body(prompt_format), "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        response = await self.http.post(ENDPOINTS[self.endpoint], json=body)
        if response.status_code != 200:
            return False
        choices = response.json().get("choices") or [{}]
        return isinstance(choices[0].get("token_ids"), list)

    def payload(self, request: BenchRequest, model: str, prompt_format: str, return_token_ids: bool = False) -> dict:
        """The JSON body for `request`, rendered in `prompt_format` (ids, text or chat)."""
        body = {"model": model, **request.body(prompt_format), "max_tokens": request.max_tokens,
                "temperature": self.temperature, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if return_token_ids:
            body["return_token_ids"] = True
        return body

    async def send(self, request: BenchRequest, index: int, model: str, prompt_format: str, run_start: float,
                   dispatch_lag_s: float = 0.0, return_token_ids: bool = False) -> RequestRecord:
        """Send one request and time it; a failure is a record with `ok=False` and the error, never a raise."""
        body = self.payload(request, model, prompt_format, return_token_ids)
        start = time.perf_counter()
        timing = {"index": index, "start_s": start - run_start, "dispatch_lag_s": dispatch_lag_s}
        try:
            async with self.http.stream("POST", ENDPOINTS[self.endpoint], json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    return RequestRecord(ok=False, e2e_s=time.perf_counter() - start,
                                         error=f"HTTP {response.status_code}: {text[:200]}", **timing)
                if self.stream:
                    return await self._read_stream(response, request, start, timing)
                payload = json.loads(await response.aread())
        except (httpx.HTTPError, OSError, json.JSONDecodeError, asyncio.TimeoutError) as error:
            return RequestRecord(ok=False, e2e_s=time.perf_counter() - start, error=f"{type(error).__name__}: {error}",
                                 **timing)
        e2e_s = time.perf_counter() - start
        usage = payload.get("usage") or {}
        return RequestRecord(ok=True, e2e_s=e2e_s,
                             num_prompt_tokens=usage.get("prompt_tokens", request.num_prompt_tokens),
                             num_output_tokens=usage.get("completion_tokens", request.max_tokens),
                             usage_reported=bool(usage), **timing)

    async def _read_stream(self, response: httpx.Response, request: BenchRequest, start: float,
                           timing: dict) -> RequestRecord:
        chunk_times: list[float] = []
        num_streamed_tokens = 0  # token ids where the server returns them, else one per chunk
        usage: dict = {}
        parse_s = 0.0
        error = ""
        async for line in response.aiter_lines():
            arrived = time.perf_counter()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = str(chunk["error"].get("message", chunk["error"]))[:200]
            if chunk.get("usage"):
                usage = chunk["usage"]
            num_tokens = sum(map(_num_tokens, chunk.get("choices") or ()))
            if num_tokens:
                chunk_times.append(arrived)
                num_streamed_tokens += num_tokens
            parse_s += time.perf_counter() - arrived
        end = time.perf_counter()
        if error or not chunk_times:
            return RequestRecord(ok=False, e2e_s=end - start, client_parse_s=parse_s,
                                 error=error or "the stream carried no text and no token ids", **timing)
        # NOTE: E2E ends at the last token, not at [DONE]: the usage chunk after it is not latency a user sees.
        return RequestRecord(ok=True, e2e_s=chunk_times[-1] - start, ttft_s=chunk_times[0] - start,
                             itl_s=tuple(b - a for a, b in zip(chunk_times, chunk_times[1:])),
                             num_prompt_tokens=usage.get("prompt_tokens", request.num_prompt_tokens),
                             num_output_tokens=usage.get("completion_tokens", num_streamed_tokens),
                             usage_reported="completion_tokens" in usage, client_parse_s=parse_s, **timing)


def _num_tokens(choice: dict) -> int:
    """Tokens a streamed choice carries: its token ids, else 1 for any text or chat content, else 0
    (a chunk with only a role or a finish reason)."""
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    delta = choice.get("delta")
    text = (delta.get("content") or delta.get("reasoning_content")) if delta is not None else choice.get("text")
    return 1 if text else 0


async def measure_loop_lag(lags_s: list[float], interval_s: float = 0.005) -> None:
    """Append how late each `interval_s` sleep wakes up, until cancelled: the event loop's own delay."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(interval_s)
        lags_s.append(max(0.0, time.perf_counter() - before - interval_s))
