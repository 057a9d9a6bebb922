"""The engine contract: what the server (and anything else that drives an engine) may call.

`LLMEngine` (one engine) and `DataParallelEngine` (replicas behind the router) both satisfy
`EngineClient`; the server, its metrics and its request validation use nothing else. The
methods marked thread-safe read only state fixed at startup, so request handlers call them off
the engine thread; every other call happens on the thread that owns the engine.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams


class QueueSizes(NamedTuple):
    """Requests (not sequences) in each queue."""

    num_waiting: int
    num_running: int
    num_swapped: int


@runtime_checkable
class EngineClient(Protocol):
    """See the module docstring."""

    tokenizer: object  # None for a model without one (token-id prompts only)
    max_model_len: int
    stream_outputs: bool  # True: every step reports every request that moved; False: finished ones only

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; `InvalidArgumentError` if it is malformed. Thread-safe."""

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the generation prompt. Thread-safe."""

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raise `RequestRejectedError` (naming the limit) if such a request could never be served. Thread-safe."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a request; raises a `PagedKVError` and queues nothing if it is malformed or can never fit."""

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""

    def step(self) -> list[RequestOutput]:
        """Run one step (or collect the replicas' outputs) and return what moved."""

    def has_unfinished_requests(self) -> bool: ...

    def queue_sizes(self) -> QueueSizes:
        """How many requests wait, run and are swapped out now."""

    def latest_stats(self):
        """The freshest `EngineStats` (or their sum over replicas) available without waiting on a step."""

    def health(self) -> list[dict] | None:
        """Per replica: index, device, alive, queue sizes, free blocks; None for a single engine."""

    def check_integrity(self) -> None:
        """Assert the block accounting holds (after a failed step, and in tests)."""

    def shutdown(self) -> None:
        """Stop workers or replicas (idempotent)."""
