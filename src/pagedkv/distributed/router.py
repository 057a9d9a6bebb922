"""The data-parallel router: which engine replica serves a new request.

Pure Python, no torch: the server calls it from request handlers and the cluster
simulator calls it from its event loop, on the very same code.

Policies:
- `prefix` (default): the replica that holds the longest cached prefix of the prompt, judged
  by the engine's own block hashes (`pagedkv.core.prefix_cache.hash_blocks`, so the router
  and every replica compute identical keys). Ties and misses go to the least-loaded replica:
  fewest waiting requests, then most free blocks, then lowest index.
- `least_loaded`: always the least-loaded replica, by the same key.
- `round_robin`: replicas in turn.

Two refinements of the prefix rule, both configurable (`RouterConfig`):

1. **Recent decisions.** A replica only *has* a prefix once it has prefilled it, so a burst
   of requests sharing a new system prompt would all miss and be spread over every replica,
   each of which then computes the same prefix. Like sglang's router (whose approximate radix
   tree records where it sent each prefix, not what the workers hold), the router also
   remembers, per block key, the replica it last sent that block to. A replica's match is
   the longer of what it reports cached and what the router remembers sending it:

       prompt keys   | h0 | h1 | h2 | h3 | h4 |
       replica 2     | cached  | cached  |              -> 2 blocks
       remembered    | -> 5    | -> 5    | -> 5 | -> 5 | -> 4 blocks for replica 5 (in flight)

   The memory is bounded (LRU over keys) and can be stale: a remembered replica may have
   evicted the blocks since. That costs one miss on a replica that was a good guess anyway.
2. **Balance guard.** Pure prefix affinity sends every request of a popular prefix to one
   replica, however busy. A replica is eligible for a prefix match only while its requests
   in flight (waiting + running) exceed the least-busy replica's by at most
   `balance_threshold` (32 by default, sglang's `balance_abs_threshold`); past that the
   request goes to the best eligible replica (a miss goes to the least-loaded one), which
   then caches the prefix too, so hot prefixes end up on as many replicas as their load
   needs. The guard counts running requests, not only waiting ones, because a replica
   slows down with its batch long before its queue grows (in the cluster simulation with
   the default cost model, a guard on waiting requests alone doubled the P99 latency).

Replica state is read through the small `Replica` protocol. Reads may race with the replica's
engine thread; they are single attribute reads and dict lookups (atomic under the GIL), so
the worst case is a slightly stale view, which only makes a routing choice less good. The
router's own state (round-robin position, memory, counters) sits behind one lock.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedkv.core.prefix_cache import BlockHash, hash_blocks
from pagedkv.engine.scheduler import Scheduler
from pagedkv.errors import ConfigError, PagedKVError, require_positive_int

DEFAULT_BALANCE_THRESHOLD = 32
DEFAULT_MAX_REMEMBERED_BLOCKS = 1 << 16


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Keys of a prompt's blocks that could hit the prefix cache (see `Router.prompt_block_hashes`)."""
    num_blocks = max(0, len(token_ids) - 1) // block_size
    return hash_blocks(token_ids[:num_blocks * block_size], block_size)


class NoReplicaAvailableError(PagedKVError):
    """Every replica was excluded (e.g. all unhealthy), so a request cannot be routed."""


class RoutingPolicy(str, enum.Enum):
    """How the router picks a replica."""

    PREFIX = "prefix"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class Replica(Protocol):
    """What the router reads from one engine replica."""

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the same on every replica)."""

    @property
    def num_waiting(self) -> int:
        """Requests queued but not yet admitted."""

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished."""

    @property
    def num_free_blocks(self) -> int:
        """KV blocks an allocation could get now (evictable cached blocks count as free)."""

    def num_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `block_hashes` the replica's prefix cache holds."""


class SchedulerReplica:
    """The `Replica` view of one engine `Scheduler` (the simulator's replicas, or a server's engines)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    @property
    def block_size(self) -> int:
        return self.scheduler.config.block_size

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    def num_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        cache = self.scheduler.block_manager.prefix_cache
        return len(cache.match(block_hashes)) if cache is not None else 0


class LoadedReplica:
    """A replica as a router sees it from afar: its queues as last reported (plus what was sent to it and not yet
    taken, counted as waiting) and the set of prefix keys it is known to hold."""

    def __init__(self, block_size: int, num_waiting: int, num_running: int, num_free_blocks: int,
                 cached: frozenset | set):
        self.block_size = block_size
        self.num_waiting = num_waiting
        self.num_running = num_running
        self.num_free_blocks = num_free_blocks
        self._cached = cached

    def num_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        count = 0
        for key in block_hashes:
            if key not in self._cached:
                break
            count += 1
        return count


@dataclass(frozen=True)
class RouterConfig:
    """Routing policy and the prefix policy's two refinements (see the module docstring).

    `balance_threshold=None` turns the balance guard off (pure prefix affinity);
    `max_remembered_blocks=0` turns the memory of recent decisions off.
    """

    policy: RoutingPolicy = RoutingPolicy.PREFIX
    balance_threshold: int | None = DEFAULT_BALANCE_THRESHOLD
    max_remembered_blocks: int = DEFAULT_MAX_REMEMBERED_BLOCKS

    def __post_init__(self):
        try:
            object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        except ValueError:
            choices = ", ".join(p.value for p in RoutingPolicy)
            raise ConfigError(f"routing policy must be one of {choices}; got {self.policy!r}") from None
        if self.balance_threshold is not None:
            require_positive_int("balance_threshold", self.balance_threshold, allow_zero=True)
        require_positive_int("max_remembered_blocks", self.max_remembered_blocks, allow_zero=True)


@dataclass(frozen=True)
class RouteDecision:
    """Where a request went and why."""

    replica: Hashable  # an index for `Router.route`, the caller's key for `Router.choose`
    num_prompt_blocks: int  # prompt blocks that could hit (all full blocks but the last token's)
    num_matched_blocks: int  # of those, the chosen replica's match (cached or remembered)
    reason: str  # "prefix", "least_loaded" (tie, miss or policy), "balance" (guard overrode), "round_robin"


@dataclass
class RouterStats:
    """Counters since construction."""

    num_routed: int = 0
    num_prefix: int = 0  # sent to a replica for its prefix match
    num_balanced: int = 0  # a longer match existed but its replica was too loaded
    num_per_replica: list[int] = field(default_factory=list)


class Router:
    """Chooses a replica for each request; safe to call from several threads.

    Two entry points over one policy: `route` for a fixed list of replicas named by index (the
    in-process data-parallel engine, the cluster simulator), and `choose` for replicas named by
    any sortable key that come and go (the Ray Serve request router, whose replicas restart and
    autoscale). Both take the prompt's block hashes when the caller already has them, so a
    prompt is hashed once on its way to a replica.
    """

    def __init__(self, replicas: Sequence[Replica], config: RouterConfig = RouterConfig(),
                 block_size: int | None = None):
        if block_size is None:
            require_positive_int("replicas", len(replicas))
            block_sizes = sorted({replica.block_size for replica in replicas})
            if len(block_sizes) > 1:
                raise ConfigError(f"replicas must share one block size to share block hashes, got {block_sizes}")
            block_size = block_sizes[0]
        require_positive_int("block_size", block_size)
        self.replicas = list(replicas)
        self.config = config
        self.block_size = block_size
        self.stats = RouterStats(num_per_replica=[0] * len(replicas))
        self._lock = threading.Lock()
        self._last_round_robin: Hashable | None = None
        self._remembered: OrderedDict[BlockHash, Hashable] = OrderedDict()  # block key -> replica last sent it

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def prompt_block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Keys of the prompt blocks that could hit: every full block that leaves the last token to compute.

        The same keys, and the same cap, as `KVBlockManager.match_prefix`: the model must run
        on the last prompt token, so a prompt of exactly k blocks can hit k - 1 of them. An
        engine given these keys with the prompt (`add_request(block_hashes=...)`) reuses them.
        """
        return prompt_block_hashes(token_ids, self.block_size)

    def route(self, token_ids: Sequence[int], exclude: Collection[int] = (),
              block_hashes: Sequence[BlockHash] | None = None) -> RouteDecision:
        """Pick a replica (by index) for a prompt, skipping the replica indices in `exclude`.

        `block_hashes`, when given, are `prompt_block_hashes(token_ids)` computed by the caller.
        Raises `NoReplicaAvailableError` (no state changes) when every replica is excluded.
        """
        num_replicas = len(self.replicas)
        candidates = [i for i in range(num_replicas) if i not in exclude]
        if not candidates:
            raise NoReplicaAvailableError(f"all {num_replicas} replicas are excluded")
        decision = self.choose({i: self.replicas[i] for i in candidates}, token_ids, block_hashes)
        with self._lock:
            self.stats.num_per_replica[decision.replica] += 1
        return decision

    def choose(self, replicas: Mapping[Hashable, Replica], token_ids: Sequence[int] = (),
               block_hashes: Sequence[BlockHash] | None = None) -> RouteDecision:
        """Pick one of `replicas` (keyed by any sortable id) for a prompt; the decision names its key.

        Pass `token_ids`, or `block_hashes` (`prompt_block_hashes` of the prompt) when already
        computed. Raises `NoReplicaAvailableError` when `replicas` is empty.
        """
        if not replicas:
            raise NoReplicaAvailableError("no replica is available")
        policy = self.config.policy
        keys: Sequence[BlockHash] = []
        if policy is RoutingPolicy.PREFIX:
            keys = block_hashes if block_hashes is not None else self.prompt_block_hashes(token_ids)
        with self._lock:
            if policy is RoutingPolicy.ROUND_ROBIN:
                decision = self._round_robin(replicas)
            elif policy is RoutingPolicy.LEAST_LOADED:
                decision = RouteDecision(self._least_loaded(replicas, list(replicas)), 0, 0, "least_loaded")
            else:
                decision = self._by_prefix(keys, replicas)
                self._remember(keys, decision.replica)
            self.stats.num_routed += 1
            self.stats.num_prefix += decision.reason == "prefix"
            self.stats.num_balanced += decision.reason == "balance"
            return decision

    # ------------------------------------------------------------------ policies
    @staticmethod
    def _least_loaded(replicas: Mapping[Hashable, Replica], candidates: Sequence[Hashable]) -> Hashable:
        # Fewest waiting, then most free blocks, then the lowest key.
        return min(candidates, key=lambda k: (replicas[k].num_waiting, -replicas[k].num_free_blocks, k))

    def _round_robin(self, replicas: Mapping[Hashable, Replica]) -> RouteDecision:
        # The next key after the last one chosen (cyclically), so an absent replica is skipped, not retried.
        ordered = sorted(replicas)
        last = self._last_round_robin
        key = next((k for k in ordered if last is not None and _after(k, last)), ordered[0])
        self._last_round_robin = key
        return RouteDecision(key, 0, 0, "round_robin")

    def _by_prefix(self, keys: Sequence[BlockHash], replicas: Mapping[Hashable, Replica]) -> RouteDecision:
        candidates = list(replicas)
        matched = {k: replicas[k].num_cached_blocks(keys) for k in candidates} if keys else {}
        if keys:
            owner, num_remembered = self._remembered_prefix(keys)
            if owner in matched:
                matched[owner] = max(matched[owner], num_remembered)
        best = max(matched.values(), default=0)
        if best == 0:
            return RouteDecision(self._least_loaded(replicas, candidates), len(keys), 0, "least_loaded")
        threshold = self.config.balance_threshold
        eligible = candidates
        if threshold is not None:
            in_flight = {k: replicas[k].num_waiting + replicas[k].num_running for k in candidates}
            limit = min(in_flight.values()) + threshold
            eligible = [k for k in candidates if in_flight[k] <= limit]
        top = max(matched[k] for k in eligible)
        if top == 0:
            return RouteDecision(self._least_loaded(replicas, eligible), len(keys), 0, "balance")
        key = self._least_loaded(replicas, [k for k in eligible if matched[k] == top])
        return RouteDecision(key, len(keys), top, "prefix" if top == best else "balance")

    # ------------------------------------------------------------------ memory of decisions
    def _remembered_prefix(self, keys: Sequence[BlockHash]) -> tuple[Hashable | None, int]:
        """The replica the router last sent the first block to, and how many leading blocks it sent there."""
        owner = self._remembered.get(keys[0])
        if owner is None:
            return None, 0
        count = 0
        for key in keys:
            if self._remembered.get(key) != owner:
                break
            count += 1
        return owner, count

    def _remember(self, keys: Sequence[BlockHash], replica: Hashable) -> None:
        capacity = self.config.max_remembered_blocks
        if capacity == 0:
            return
        remembered = self._remembered
        for key in keys[:capacity]:  # leading blocks: a remembered prefix is read from the first block on
            remembered[key] = replica
            remembered.move_to_end(key)
        while len(remembered) > capacity:
            remembered.popitem(last=False)


def _after(key: Hashable, last: Hashable) -> bool:
    return key > last  # type: ignore[operator]  # replica keys are ints or strings


__all__: Sequence[str] = [
    "LoadedReplica",
    "NoReplicaAvailableError",
    "Replica",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "RouterStats",
    "RoutingPolicy",
    "SchedulerReplica",
    "prompt_block_hashes",
]
