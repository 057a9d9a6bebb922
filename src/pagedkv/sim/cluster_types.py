"""What a cluster simulation is asked and what it measures: its config, a latency target, its result.

`ClusterConfig` is R identical replicas (one `SchedulerConfig`) behind a router (one `RouterConfig`),
with the share of requests left out as warm-up and the way the router sees the replicas
(`REPLICA_VIEWS`, described in `pagedkv.sim.cluster`). `ClusterResult` holds a run's figures in simulated
seconds, its latencies as nearest-rank percentiles (`percentile`), and `LatencyTarget` says whether they
meet a deployment's P99 limits. The simulation itself is `pagedkv.sim.cluster.ClusterSimulation`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceT
from dataclasses import asdict, dataclass

from pagedkv.distributed.router import RouterConfig
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import ConfigError, require_positive_int

DEFAULT_WARMUP_FRACTION = 0.2


REPLICA_VIEWS: tuple[str, ...] = ("live", "published", "published+sent")


@dataclass(frozen=True)
class ClusterConfig:
    """R identical replicas, each with this scheduler config, behind a router with this config."""

    num_replicas: int
    scheduler: SchedulerConfig
    router: RouterConfig = RouterConfig()
    warmup_fraction: float = DEFAULT_WARMUP_FRACTION
    replica_view: str = "live"

    def __post_init__(self):
        require_positive_int("num_replicas", self.num_replicas)
        if self.replica_view not in REPLICA_VIEWS:
            raise ConfigError(f"replica_view must be one of {', '.join(REPLICA_VIEWS)}; got {self.replica_view!r}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ConfigError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")


@dataclass(frozen=True)
class LatencyTarget:
    """P99 latency limits a deployment must meet (None: no limit on that latency)."""

    p99_ttft_s: float | None = None
    p99_e2e_s: float | None = None

    def __post_init__(self):
        for name in ("p99_ttft_s", "p99_e2e_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0 or None, got {value!r}")
        if self.p99_ttft_s is None and self.p99_e2e_s is None:
            raise ConfigError("a latency target needs p99_ttft_s, p99_e2e_s or both")

    def is_met(self, result: ClusterResult) -> bool:
        """Whether `result`'s P99 latencies are within the limits."""
        return ((self.p99_ttft_s is None or result.ttft_p99_s <= self.p99_ttft_s)
                and (self.p99_e2e_s is None or result.e2e_p99_s <= self.p99_e2e_s))

    def describe(self) -> str:
        parts = [f"P99 {name} <= {value:g} s" for name, value in (("TTFT", self.p99_ttft_s), ("E2E", self.p99_e2e_s))
                 if value is not None]
        return " and ".join(parts)


@dataclass(frozen=True)
class ClusterResult:
    """What one cluster simulation measured (times in simulated seconds; requests after warm-up)."""

    policy: str
    num_replicas: int
    num_requests: int
    num_measured: int  # requests after the warm-up, which the latency and hit-rate figures describe
    num_rejected: int
    sim_time_s: float
    offered_requests_per_s: float  # the arrival rate the requests realised
    throughput_tokens_per_s: float  # all requests' output tokens / sim_time_s (as vLLM's benchmark_serving)
    throughput_requests_per_s: float  # finished requests / sim_time_s
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    prefix_hit_rate: float  # prompt tokens served by the prefix cache at first admission / prompt tokens
    num_prefill_tokens: int  # prompt tokens computed by every replica (recomputation included)
    num_preemptions: int
    num_steps: int
    prefix_routed_share: float  # requests the router sent for a prefix match
    balanced_share: float  # requests the balance guard moved off a longer match
    max_replica_load: float  # the busiest replica's requests / the mean (1.0 = even)

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: SequenceT[float], p: float) -> float:
    """Nearest-rank percentile `p` in (0, 100] of `values` (0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]
