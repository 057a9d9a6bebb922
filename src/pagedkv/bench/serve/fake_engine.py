"""An engine stand-in that emits tokens at a fixed step rate, to measure the server path alone.

`FakeEngine` satisfies `EngineClient` without a model: every `step()` waits for the next step
boundary (`step_ms` apart; it sleeps, releasing the interpreter lock as a GPU wait does), then
holds the lock for `busy_ms` (the engine's own host work: scheduling, launches, outputs), then
gives every running request (up to `max_num_seqs`) one token and reports it the way
`LLMEngine` does with `stream_outputs` on: a `RequestOutput` per request holding its whole
state so far. Requests are admitted in arrival order; the first token comes one step after a
request is admitted (its "prefill"). Token ids are a function of the request's position, so
runs repeat exactly.

With a GPU's step rate (256 decode rows every ~10 ms is ~25k tok/s) the server must keep up
with the engine; what it cannot deliver shows as lower tok/s and a longer inter-token tail.
`DataParallelEngine(..., engine_factory=FakeEngine.factory(config))`
runs it in a process of its own, as `pagedkv serve --engine-process` does with the real one.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field

from pagedkv.engine.client import QueueSizes
from pagedkv.engine.output_processor import tokenize_prompt
from pagedkv.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import ConfigError, InvalidArgumentError, require_positive_int

#: Blocks of the stand-in's pool: enough that no request is refused for size.
_NUM_BLOCKS = 1 << 20


@dataclass(frozen=True)
class FakeEngineConfig:
    """step_ms: time from one step's start to the next (0: back to back). busy_ms: host work per step,
    spent holding the interpreter lock (a busy loop). vocab_size bounds token ids; text: each token
    also decodes to a short word (False: no text, like a model served without a tokenizer)."""

    step_ms: float = 10.0
    busy_ms: float = 0.0
    max_num_seqs: int = 256
    max_model_len: int = 8192
    vocab_size: int = 32_000
    text: bool = False

    def __post_init__(self):
        for name in ("step_ms", "busy_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a number of milliseconds >= 0, got {value!r}")
        for name in ("max_num_seqs", "max_model_len", "vocab_size"):
            require_positive_int(name, getattr(self, name))


@dataclass
class _FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_s: float | None = None


class FakeEngine:
    """See the module docstring. Only n = 1 and no logprobs: it measures the plain streaming path."""

    tokenizer = None

    def __init__(self, config: FakeEngineConfig = FakeEngineConfig()):
        self.config = config
        self.max_model_len = config.max_model_len
        self.stream_outputs = True
        self.device = "cpu"
        # A real scheduler, used only for its admission check and the figures replicas publish.
        self.scheduler = Scheduler(SchedulerConfig(num_blocks=_NUM_BLOCKS, max_model_len=config.max_model_len,
                                                   max_num_seqs=config.max_num_seqs))
        self._waiting: deque[_FakeRequest] = deque()
        self._running: dict[str, _FakeRequest] = {}
        self._next_step_s = 0.0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    @staticmethod
    def factory(config: FakeEngineConfig) -> functools.partial:
        """A picklable `engine_factory` for `DataParallelEngine`: builds `FakeEngine(config)` in the replica."""
        return functools.partial(_build, config)

    # ------------------------------------------------------------------ EngineClient
    def tokenize(self, prompt):
        return tokenize_prompt(None, self.config.vocab_size, prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        raise InvalidArgumentError("the fake engine has no tokenizer, so it has no chat template")

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        self.scheduler.check_fits(num_prompt_tokens, max_tokens, n)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0) -> None:
        params = params or SamplingParams()
        if params.n != 1 or params.logprobs is not None:
            raise InvalidArgumentError("the fake engine serves n = 1 without logprobs only")
        if request_id in self._running or any(r.request_id == request_id for r in self._waiting):
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        _, token_ids = self.tokenize(prompt)
        self.check_fits(len(token_ids), params.max_tokens, params.n)
        self._waiting.append(_FakeRequest(request_id, token_ids, params, time.perf_counter()))

    def abort(self, request_id: str) -> bool:
        if self._running.pop(request_id, None) is not None:
            return True
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def queue_sizes(self) -> QueueSizes:
        return QueueSizes(len(self._waiting), len(self._running), 0)

    def step(self) -> list[RequestOutput]:
        """Wait for the step boundary, spend `busy_ms` on the host, then one token per running request."""
        config = self.config
        now = time.perf_counter()
        if self._next_step_s > now:
            time.sleep(self._next_step_s - now)
        start = time.perf_counter()
        self._next_step_s = max(self._next_step_s, start - config.step_ms / 1000) + config.step_ms / 1000
        busy_until = start + config.busy_ms / 1000
        while time.perf_counter() < busy_until:  # host work holds the interpreter lock, as the engine's does
            pass
        self.num_steps += 1
        outputs = [self._advance(request) for request in list(self._running.values())]
        while self._waiting and len(self._running) < config.max_num_seqs:  # admitted now, first token next step
            request = self._waiting.popleft()
            self._running[request.request_id] = request
            self.num_prompt_tokens += len(request.prompt_token_ids)
        return [output for output in outputs if output is not None]

    def _advance(self, request: _FakeRequest) -> RequestOutput | None:
        position = len(request.prompt_token_ids) + len(request.token_ids)
        token = (position * 7919 + len(request.prompt_token_ids)) % self.config.vocab_size
        request.token_ids.append(token)
        if self.config.text:
            request.text += f" w{token % 1000}"
        if request.first_token_s is None:
            request.first_token_s = time.perf_counter()
        self.num_generated_tokens += 1
        finished = len(request.token_ids) >= request.params.max_tokens
        if finished:
            del self._running[request.request_id]
        elif not self.stream_outputs:
            return None
        completion = CompletionOutput(0, request.text, list(request.token_ids), "length" if finished else None)
        metrics = {"arrival_time": request.arrival_s, "first_token_time": request.first_token_s}
        return RequestOutput(request.request_id, None, request.prompt_token_ids, [completion], finished,
                             metrics=metrics)

    def stats(self) -> EngineStats:
        return EngineStats(num_blocks=_NUM_BLOCKS, block_size=16, num_used_blocks=0, num_free_blocks=_NUM_BLOCKS,
                           peak_used_blocks=0, num_preemptions=0, num_swap_outs=0, num_swap_ins=0, num_rejected=0,
                           num_request_failures=0, prefix_cache_queries=0, prefix_cache_hits=0,
                           prefix_cache_hit_tokens=0, num_prompt_tokens=self.num_prompt_tokens,
                           num_generated_tokens=self.num_generated_tokens, num_steps=self.num_steps,
                           busy_seconds=0.0)

    def latest_stats(self) -> EngineStats:
        return self.stats()

    def health(self) -> None:
        return None

    def check_integrity(self) -> None:
        """Nothing to check: the stand-in holds no blocks."""

    def shutdown(self) -> None:
        """Nothing to stop."""


def _build(config: FakeEngineConfig, engine_config=None) -> FakeEngine:
    """`FakeEngine(config)`; the replica's `EngineConfig` is ignored (the stand-in has no device)."""
    return FakeEngine(config)
