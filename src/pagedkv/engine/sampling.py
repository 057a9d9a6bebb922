"""Sampling parameters: what a request asks of decoding, validated at construction.

Pure Python (the simulator and the server validate requests without torch). The sampler
that applies them to logits lives in `pagedkv.engine.sampler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedkv.errors import SamplingParamsError


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1.0 turn those filters off. A seed
    makes a request's samples reproducible whatever else shares its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.n) or self.n < 1:
            raise SamplingParamsError("n", f"must be an int >= 1, got {self.n!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise SamplingParamsError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError("top_k", f"must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if (not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool)
                or not 0.0 < self.top_p <= 1.0):
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamsError("seed", f"must be an int or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingParamsError("stop", f"stop strings must be non-empty str, got {text!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise SamplingParamsError("stop_token_ids", f"token ids must be ints >= 0, got {token_id!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        """Whether decoding takes the argmax."""
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        return False

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
