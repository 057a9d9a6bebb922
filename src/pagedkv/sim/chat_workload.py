"""The cluster simulator's workload: open-loop chat requests that share system prompts.

Each request is one of `num_system_prompts` system prompts (drawn by Zipf popularity: the
k-th most popular with weight 1 / k^s), then a user message of its own, then a generated
answer (`ignore_eos`, so it ends exactly at its drawn length):

    | system prompt k: same tokens in every request that uses k | user message: its own | answer |
    | cacheable: (system_prompt_tokens // block_size) blocks    | the block with the seam and after never hit |

Arrivals are open loop (they do not wait for answers), in one of two processes of the same
mean rate:
- `poisson`: exponential gaps at `rate_per_s`;
- `bursty`: a two-state Markov-modulated Poisson process. Bursts at `burst_factor` x the mean
  rate take `burst_fraction` of the time, in spells of `mean_burst_s` on average; the calm
  rate between them is whatever keeps the mean at `rate_per_s`.

Everything comes from SplitMix64 streams derived from the seed (the same requests on any
machine); a system prompt's tokens depend only on the seed and its index.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pagedkv.core.workload import SplitMix64
from pagedkv.errors import ConfigError, require_positive_int
from pagedkv.sim.workload import DEFAULT_SEED, DEFAULT_VOCAB_SIZE, Job, random_tokens

ARRIVAL_PROCESSES: tuple[str, ...] = ("poisson", "bursty")

# Independent streams for arrivals, prompt choice and lengths, user tokens, system-prompt tokens.
_ARRIVAL_SALT = 0xA441_7A15
_REQUEST_SALT = 0x2E0_0E57
_USER_SALT = 0x05E2_70CE
_SYSTEM_SALT = 0x5_75E3


@dataclass(frozen=True)
class ChatWorkload:
    """How many chat requests arrive, how fast, and what they look like."""

    num_requests: int = 4096
    rate_per_s: float = 100.0
    arrival: str = "poisson"
    num_system_prompts: int = 32
    system_prompt_tokens: int = 1000
    zipf_exponent: float = 1.0
    min_user_tokens: int = 16
    max_user_tokens: int = 256
    min_output_tokens: int = 16
    max_output_tokens: int = 256
    burst_factor: float = 3.0
    burst_fraction: float = 0.2
    mean_burst_s: float = 1.0
    seed: int = DEFAULT_SEED
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __post_init__(self):
        for name in ("num_requests", "num_system_prompts", "min_user_tokens", "min_output_tokens", "vocab_size"):
            require_positive_int(name, getattr(self, name))
        require_positive_int("system_prompt_tokens", self.system_prompt_tokens, allow_zero=True)
        for low, high in (("min_user_tokens", "max_user_tokens"), ("min_output_tokens", "max_output_tokens")):
            if getattr(self, high) < getattr(self, low):
                raise ConfigError(f"{high} ({getattr(self, high)}) must be >= {low} ({getattr(self, low)})")
        if self.arrival not in ARRIVAL_PROCESSES:
            raise ConfigError(f"arrival must be one of {', '.join(ARRIVAL_PROCESSES)}; got {self.arrival!r}")
        for name in ("rate_per_s", "burst_factor", "mean_burst_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.zipf_exponent < 0:
            raise ConfigError(f"zipf_exponent must be >= 0, got {self.zipf_exponent}")
        if not 0.0 < self.burst_fraction < 1.0:
            raise ConfigError(f"burst_fraction must be in (0, 1), got {self.burst_fraction}")
        if self.burst_factor * self.burst_fraction >= 1.0:
            raise ConfigError(f"burst_factor x burst_fraction must be < 1 (bursts alone would exceed the mean rate), "
                              f"got {self.burst_factor} x {self.burst_fraction}")

    @property
    def max_request_tokens(self) -> int:
        """The longest request: prompt plus answer."""
        return self.system_prompt_tokens + self.max_user_tokens + self.max_output_tokens

    @property
    def calm_rate_per_s(self) -> float:
        """The bursty process's rate between bursts (keeps the mean at `rate_per_s`)."""
        return self.rate_per_s * (1 - self.burst_factor * self.burst_fraction) / (1 - self.burst_fraction)


@dataclass(frozen=True)
class ChatRequest:
    """One request: when it arrives, which system prompt it starts with, and its job."""

    arrival_s: float
    system_prompt: int
    job: Job


def _exponential(rng: SplitMix64, rate: float) -> float:
    return -math.log(1.0 - rng.uniform()) / rate


def arrival_times(workload: ChatWorkload) -> list[float]:
    """`num_requests` arrival instants (seconds from 0) of the workload's arrival process."""
    rng = SplitMix64(workload.seed ^ _ARRIVAL_SALT)
    times: list[float] = []
    now = 0.0
    if workload.arrival == "poisson":
        for _ in range(workload.num_requests):
            now += _exponential(rng, workload.rate_per_s)
            times.append(now)
        return times
    rates = (workload.calm_rate_per_s, workload.burst_factor * workload.rate_per_s)
    mean_spell_s = (workload.mean_burst_s * (1 - workload.burst_fraction) / workload.burst_fraction,
                    workload.mean_burst_s)
    state = 1 if rng.uniform() < workload.burst_fraction else 0  # start in the stationary mix
    spell_end = _exponential(rng, 1.0 / mean_spell_s[state])
    while len(times) < workload.num_requests:
        gap = _exponential(rng, rates[state])
        if now + gap < spell_end:
            now += gap
            times.append(now)
            continue
        # Memoryless: drop the gap at the switch and draw afresh at the new state's rate.
        now = spell_end
        state = 1 - state
        spell_end = now + _exponential(rng, 1.0 / mean_spell_s[state])
    return times


def system_prompt_tokens(workload: ChatWorkload, index: int) -> list[int]:
    """The tokens of system prompt `index`: the same for every request (and every run) of this seed."""
    return random_tokens(SplitMix64(workload.seed ^ _SYSTEM_SALT ^ (index * 0x9E3779B97F4A7C15)),
                   workload.system_prompt_tokens, workload.vocab_size)


def make_chat_requests(workload: ChatWorkload) -> list[ChatRequest]:
    """The workload's requests in arrival order, identical for the same `ChatWorkload`."""
    systems = [tuple(system_prompt_tokens(workload, k)) for k in range(workload.num_system_prompts)]
    cumulative: list[float] = []
    total = 0.0
    for rank in range(1, workload.num_system_prompts + 1):
        total += rank ** -workload.zipf_exponent
        cumulative.append(total)
    pick_rng = SplitMix64(workload.seed ^ _REQUEST_SALT)
    user_rng = SplitMix64(workload.seed ^ _USER_SALT)
    requests = []
    for index, arrival_s in enumerate(arrival_times(workload)):
        system = min(bisect.bisect_right(cumulative, pick_rng.uniform() * total), workload.num_system_prompts - 1)
        num_user = pick_rng.randint(workload.min_user_tokens, workload.max_user_tokens)
        num_output = pick_rng.randint(workload.min_output_tokens, workload.max_output_tokens)
        prompt = systems[system] + tuple(random_tokens(user_rng, num_user, workload.vocab_size))
        requests.append(ChatRequest(arrival_s, system, Job(index, prompt, num_output)))
    return requests
