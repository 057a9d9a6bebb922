"""A deterministic workload generator: the same seed gives the same lengths everywhere.

Python's `random` only promises reproducible `random()` across versions, and C++'s
distributions differ between standard libraries (PageFault's lengths changed by platform).
So lengths come from SplitMix64, a fixed 64-bit integer recurrence, with rejection sampling
for unbiased bounded integers: pure integer arithmetic, identical on every platform.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError, require_positive_int

_MASK64 = (1 << 64) - 1


class SplitMix64:
    """The SplitMix64 generator (Steele, Lea, Flood 2014): tiny, fast, fully specified."""

    def __init__(self, seed: int):
        self.state = seed & _MASK64

    def next_u64(self) -> int:
        """The next 64-bit output."""
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def randint(self, low: int, high: int) -> int:
        """Uniform integer in [low, high], both ends included, without modulo bias."""
        if high < low:
            raise InvalidArgumentError(f"randint range [{low}, {high}] is empty")
        span = high - low + 1
        limit = (1 << 64) - (1 << 64) % span
        while True:
            x = self.next_u64()
            if x < limit:
                return low + x % span

    def uniform(self) -> float:
        """Uniform float in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) / float(1 << 53)


@dataclass(frozen=True)
class LengthBucket:
    """A share of the workload with lengths uniform in [min_len, max_len]."""

    name: str
    weight: float
    min_len: int
    max_len: int

    def __post_init__(self):
        require_positive_int(f"{self.name}.min_len", self.min_len)
        if self.max_len < self.min_len:
            raise InvalidArgumentError(f"{self.name}: max_len {self.max_len} < min_len {self.min_len}")
        if self.weight < 0:
            raise InvalidArgumentError(f"{self.name}: weight must be >= 0, got {self.weight}")


#: PageFault's mix: 50% short (32-128), 30% medium (256-512), 20% long (1024-2048).
DEFAULT_MIX: tuple[LengthBucket, ...] = (
    LengthBucket("short", 0.5, 32, 128),
    LengthBucket("medium", 0.3, 256, 512),
    LengthBucket("long", 0.2, 1024, 2048),
)


def generate_lengths(num_seqs: int, seed: int = 42, mix: Sequence[LengthBucket] = DEFAULT_MIX) -> list[int]:
    """`num_seqs` sequence lengths drawn from `mix`, identical for the same seed on any platform."""
    require_positive_int("num_seqs", num_seqs, allow_zero=True)
    total_weight = sum(bucket.weight for bucket in mix)
    if total_weight <= 0:
        raise InvalidArgumentError("the length mix has no positive weight")
    rng = SplitMix64(seed)
    lengths = []
    for _ in range(num_seqs):
        pick = rng.uniform() * total_weight
        for bucket in mix:
            pick -= bucket.weight
            if pick < 0:
                break
        lengths.append(rng.randint(bucket.min_len, bucket.max_len))
    return lengths
