"""pagedkv's routing policy as Ray Serve's request router for the engine deployment.

Ray Serve asks a request router, for each call on a deployment handle, which replica should
take it (`choose_replicas`). This one hands the question to `pagedkv.distributed.router.Router`,
the same policy (prefix-aware, least-loaded or round-robin, with the balance guard and the memory
of recent decisions) that the in-process data-parallel engine and `pagedkv sim --cluster` use.
Replicas are keyed by their Ray Serve replica id, so replicas that autoscaling adds or removes,
or that Ray restarts (under a new id), simply appear in or leave the candidate set.

What the policy reads about a replica, and where it comes from:

- **load** (waiting and running requests, free KV blocks): the replica's `record_routing_stats`,
  which the Serve controller polls every `request_routing_stats_period_s` and hands to every
  router with the replica list. It is therefore up to one period old;
- **requests sent but not yet taken**: this router counts what it sent to each replica
  (`on_send_request`), and the replica publishes how many `generate` calls each sender has
  started; the difference counts as waiting. A burst routed between two stats updates thus
  sees every earlier request of the burst instead of a stale zero (without it, the cluster
  simulation put a whole burst on one replica). The count is capped by Ray's own count of
  requests in flight to the replica, so a request the replica refused cannot inflate it for good;
- **held prefixes**: the router's memory of which replica it sent each prompt block to, and
  the keys of the blocks each replica cached most recently (from its stats: its GPU prefix
  cache's, then its host tier's), which cover what other ingress replicas sent and what a
  restarted router forgot.

The prompt's block hashes are computed once by the ingress (`RayEngineClient`) and travel as
the call's `block_hashes` argument: the router matches on them and the replica's engine reuses
them. Why routing stats rather than a shared actor: they ride on a channel Ray Serve already
runs (no extra actor to keep alive, no call on the request path), the one thing that must be
fresh per request (what this router sent) is counted locally, and the staleness that remains
(queues up to one period old) costs a routing choice a little, never correctness.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedkv.distributed.router import (DEFAULT_BALANCE_THRESHOLD, DEFAULT_MAX_REMEMBERED_BLOCKS, LoadedReplica, Router,
                                       RouterConfig)

#: The engine deployment's method whose calls carry a prompt (others go to the least-loaded replica).
GENERATE_METHOD = "generate"


class _ReplicaView(LoadedReplica):
    """One Ray Serve replica as the `Replica` protocol of the routing policy (see the module docstring)."""

    def __init__(self, replica: RunningReplica, block_size: int, num_unconsumed: int, cached: frozenset):
        stats = replica.routing_stats or {}
        super().__init__(block_size, stats.get("num_waiting", 0) + num_unconsumed, stats.get("num_running", 0),
                         stats.get("num_free_blocks", 0), cached)
        self.replica = replica


class PagedKVRequestRouter(RequestRouter):
    """Ray Serve request router over pagedkv's routing policy; configured through `request_router_kwargs`."""

    def initialize_state(self, policy: str = "prefix", block_size: int = 16,
                         balance_threshold: int | None = DEFAULT_BALANCE_THRESHOLD,
                         max_remembered_blocks: int = DEFAULT_MAX_REMEMBERED_BLOCKS, **kwargs) -> None:
        """Called by Ray Serve with `request_router_kwargs` (JSON values) once, before any request."""
        config = RouterConfig(policy, balance_threshold, max_remembered_blocks)
        self.policy = Router([], config, block_size=block_size)
        self.sender = uuid.uuid4().hex  # how replicas tell this router's requests from other routers'
        self._num_sent: Counter[str] = Counter()
        self._cached: dict[str, tuple[dict, frozenset]] = {}  # replica -> (its stats, their key set)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The policy's choice first; every other candidate as the fallback rank (if the choice is full)."""
        if not candidate_replicas:
            return []
        token_ids: Sequence[int] = ()
        block_hashes = None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off, not spin, when all are full
            method = pending_request.metadata.call_method
            pin = pending_request.kwargs.get("replica")
            if pin:
                # Pinned to the replica it names (an output stream, a lane's address, a request its lane sent
                # there); if that one is gone, any replica answers at once that it is not the one.
                pinned = [r for r in candidate_replicas if r.replica_id.unique_id == pin]
                return [pinned] if pinned else [candidate_replicas]
            if method == GENERATE_METHOD:
                # The ingress names itself (its output streams are keyed by it); the count below follows it.
                self.sender = pending_request.kwargs.setdefault("sender", self.sender)
                block_hashes = pending_request.kwargs.get("block_hashes")
                if len(pending_request.args) > 1:
                    token_ids = pending_request.args[1]
        views = {r.replica_id.unique_id: self._view(r) for r in candidate_replicas}
        decision = self.policy.choose(views, token_ids, block_hashes)
        chosen = views[decision.replica].replica
        rest = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    def _view(self, replica: RunningReplica) -> _ReplicaView:
        key = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        num_started = stats.get("num_started", {}).get(self.sender, 0)
        num_unconsumed = max(0, self._num_sent[key] - num_started)
        in_flight = self.replica_queue_len_cache.get(replica.replica_id)
        if in_flight is not None:
            num_unconsumed = min(num_unconsumed, in_flight)
        cached = self._cached.get(key)
        if cached is None or cached[0] is not stats:  # new stats: build their key set once
            cached = (stats, frozenset(stats.get("block_hashes", ())))
            self._cached[key] = cached
        return _ReplicaView(replica, self.policy.block_size, num_unconsumed, cached[1])

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Ray Serve sent a request to `replica_id`: count it until the replica reports it started."""
        super().on_send_request(replica_id)
        self._num_sent[replica_id.unique_id] += 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """The replica set changed (autoscaling, a restart): forget the counts of replicas that left."""
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for key in [k for k in self._num_sent if k not in live]:
            del self._num_sent[key]
        for key in [k for k in self._cached if k not in live]:
            del self._cached[key]
