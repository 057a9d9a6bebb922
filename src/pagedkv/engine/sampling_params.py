"""Sampling parameters: what a request asks of decoding, validated at construction.

Pure Python (the simulator and the server validate requests without torch). The sampler
that applies them to logits lives in `pagedkv.engine.sampler`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.errors import SamplingParamsError

SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.manual_seed accepts; a seed names a 64-bit stream
GREEDY_TEMPERATURE = 1e-5  # below this, temperature is greedy (vLLM's epsilon): logits / 1e-38 overflow
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in OpenAI's API
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...] | None:
    """`logit_bias` as sorted (token id, bias) pairs, so the frozen params stay hashable; None when empty."""
    if value is None:
        return None
    if not isinstance(value, (Mapping, list, tuple)):
        raise SamplingParamsError("logit_bias", f"must map token ids to biases, got {value!r}")
    pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise SamplingParamsError("logit_bias", f"must map token ids to biases, got the entry {pair!r}")
        token_id, bias = pair
        if not _is_int(token_id) or token_id < 0:
            raise SamplingParamsError("logit_bias", f"token ids must be ints >= 0, got {token_id!r}")
        if not _is_finite(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                                    f"got {bias!r} for token {token_id}")
    if len({token_id for token_id, _ in pairs}) != len(pairs):
        raise SamplingParamsError("logit_bias", "a token id appears twice")
    return tuple(sorted((token_id, float(bias)) for token_id, bias in pairs)) or None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (or below 1e-5) is greedy. top_k 0 (or -1) and top_p 1.0 turn those filters
    off. A seed makes a request's samples reproducible whatever else shares its batch; seeds are
    taken modulo 2**64, so -1 and 2**64 - 1 name the same stream.

    Penalties follow OpenAI/vLLM: `presence_penalty` is subtracted once from every token already
    in the output, `frequency_penalty` once per occurrence, and `repetition_penalty` (HF's)
    divides positive and multiplies negative logits of tokens in the prompt or the output.
    `logit_bias` maps token ids to a bias added to their logits (-100 bans, +100 forces).
    `min_tokens` masks EOS and `stop_token_ids` until that many tokens were generated.
    `logprobs` k asks for the sampled token's log-probability plus the k most likely tokens.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
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
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise SamplingParamsError("seed", f"must be an int in [-2**63, 2**64 - 1] or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError("min_tokens", f"must be an int in [0, max_tokens={self.max_tokens}], "
                                                    f"got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or abs(value) > MAX_PENALTY:
                raise SamplingParamsError(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SamplingParamsError("repetition_penalty",
                                      f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}], "
                                                  f"got {self.logprobs!r}")
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
        """Whether decoding takes the argmax (temperature below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the prompt and output token ids (a presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_penalties(self) -> bool:
        """Whether the logits are adjusted before sampling (penalties, logit_bias or min_tokens)."""
        return self.needs_history or self.logit_bias is not None or self.min_tokens > 0

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise `SamplingParamsError` if `logit_bias` or `stop_token_ids` names a token outside the vocabulary."""
        for name, token_ids in (("logit_bias", [t for t, _ in self.logit_bias or ()]),
                                ("stop_token_ids", self.stop_token_ids)):
            for token_id in token_ids:
                if token_id >= vocab_size:
                    raise SamplingParamsError(name, f"token id {token_id} is outside the vocabulary "
                                                    f"(size {vocab_size})")
