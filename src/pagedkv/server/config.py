"""What the HTTP server enforces beyond the engine: auth, size limits, backpressure, timeouts.

One frozen dataclass, validated at construction, that `pagedkv serve` flags map onto. The
engine's own limits (max_model_len, max_num_seqs, the KV pool) stay in `EngineConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import ConfigError, require_positive_int

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    """Limits and policies of one server.

    api_key: every /v1 route, /tokenize and /detokenize need `Authorization: Bearer KEY`
    (and /metrics too with `protect_metrics`). None turns auth off; an empty key is an error,
    because an empty `$PAGEDKV_API_KEY` must not silently mean "no auth".

    max_request_body_bytes: larger bodies get a 413 before any of them is parsed.
    max_prompt_chars: a text prompt (or the messages' text) longer than this is refused before
    tokenizing. None derives it from max_model_len and the tokenizer's longest token, so that
    only a prompt that cannot fit is refused.

    max_queue: requests accepted but not yet generating (waiting for the engine, or being
    prefilled) beyond which new ones get a 429 with `Retry-After: retry_after_s`. None: no limit.
    request_timeout_s: a request still unfinished this long after it arrived is aborted (504,
    or an error event when streaming). None: no limit.
    """

    api_key: str | None = None
    protect_metrics: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompt_chars: int | None = None
    max_queue: int | None = None
    request_timeout_s: float | None = None
    retry_after_s: int = 1
    ignore_unknown_fields: bool = False

    def __post_init__(self):
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ConfigError("the API key is empty: pass a non-empty --api-key / $PAGEDKV_API_KEY, or unset it "
                              "to turn auth off")
        require_positive_int("max_request_body_bytes", self.max_request_body_bytes)
        if self.max_prompt_chars is not None:
            require_positive_int("max_prompt_chars", self.max_prompt_chars)
        if self.max_queue is not None:
            require_positive_int("max_queue", self.max_queue)
        require_positive_int("retry_after_s", self.retry_after_s)
        timeout = self.request_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise ConfigError(f"request_timeout_s must be a number of seconds > 0, got {timeout!r}")
