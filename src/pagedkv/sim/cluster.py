"""The cluster simulator: R engine replicas behind the real router, on one simulated clock.

Each replica is the engine's own `Scheduler` (and through it the block manager and prefix
cache), stepped as `pagedkv.sim.simulator` steps one: `fake_step` gives the step's shape and
sampled tokens, the `CostModel` its duration. The router is `pagedkv.distributed.router.Router`,
reading the replicas through a `Replica` view (below).

The router sees each replica one of two ways (`ClusterConfig.replica_view`):
- `live`: `SchedulerReplica`, the scheduler's state as it is now, prefix cache included (an
  in-process server);
- `published`: as `pagedkv.distributed.data_parallel` shows a replica process to the router: its
  load as published at the end of its last step (requests routed since are not counted),
  and no cache queries (the router's memory of its decisions stands in);
- `published+sent`: the same, plus the requests sent to the replica since its last step
  counted as waiting (a router that counts what it sent, as sglang's does).

The event loop is a heap of step completions, one entry per busy replica, merged with the
arrival list; an idle replica costs nothing:

    arrival at t     route -> replica r; queue it; if r is idle, r schedules a step now
    step end at t    r's step is recorded (`update`); if r has work left, its next step starts at t

A step's decisions (admission, blocks) are made when it starts and its results (sampled
tokens, newly cached prefix blocks) land when it ends, as in the engine, so a request routed
while its prefix is being prefilled elsewhere does not see it yet. A step ending at the same
instant as an arrival is recorded first.

Latencies are per request, in simulated seconds from arrival: time to first token (the end
of the step that sampled it) and end-to-end (the end of the step that sampled its last).
Percentiles are nearest-rank. The first `warmup_fraction` of the requests (by arrival) are
simulated but left out of the latency and hit-rate figures, so those describe caches that
have seen the workload rather than cold replicas. Throughput is every request's output
tokens over the whole run, first arrival to last token (as vLLM's `benchmark_serving`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable
from collections.abc import Sequence as SequenceT
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from pagedkv.core.prefix_cache import BlockHash
from pagedkv.distributed.router import Router, SchedulerReplica
from pagedkv.engine.scheduler import Scheduler
from pagedkv.errors import RequestRejectedError, require_positive_int
from pagedkv.sim.chat_workload import ChatRequest, ChatWorkload, make_chat_requests
from pagedkv.sim.cluster_types import (
    DEFAULT_WARMUP_FRACTION,
    REPLICA_VIEWS,
    ClusterConfig,
    ClusterResult,
    LatencyTarget,
    percentile,
)
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.simulator import fake_step, job_sequence

# The config, target and result types live in cluster_types.py; they are imported from here too.
__all__ = ["DEFAULT_WARMUP_FRACTION", "REPLICA_VIEWS", "ClusterConfig", "ClusterResult", "ClusterSimulation",
           "ClusterTask", "LatencyTarget", "PublishedReplica", "SizingResult", "percentile", "replicas_needed",
           "run_task", "run_tasks", "simulate_cluster"]


class PublishedReplica:
    """A replica as a replica process shows it to the router: load as of its last step, no cache queries.

    With `count_sent`, its waiting count also holds the requests the router sent it since
    that step (`note_sent`), which the process has not seen yet.
    """

    def __init__(self, scheduler: Scheduler, count_sent: bool = False):
        self.scheduler = scheduler
        self.block_size = scheduler.config.block_size
        self.count_sent = count_sent
        self.publish()

    def publish(self) -> None:
        """Take the load the router sees until the next call (the end of the replica's next step)."""
        self._num_published_waiting = len(self.scheduler.waiting)
        self._num_sent = 0
        self.num_running = len(self.scheduler.running)
        self.num_free_blocks = self.scheduler.block_manager.num_free_blocks

    def note_sent(self) -> None:
        """The router sent this replica a request."""
        self._num_sent += 1

    @property
    def num_waiting(self) -> int:
        return self._num_published_waiting + (self._num_sent if self.count_sent else 0)

    def num_cached_blocks(self, block_hashes: SequenceT[BlockHash]) -> int:
        return 0


class ClusterSimulation:
    """One run: fresh replicas and router for `config`, fed `requests` open loop."""

    def __init__(self, config: ClusterConfig, requests: SequenceT[ChatRequest], cost_model: CostModel):
        require_positive_int("requests", len(requests))
        self.config = config
        self.requests = list(requests)
        self.cost_model = cost_model
        self.schedulers = [Scheduler(config.scheduler) for _ in range(config.num_replicas)]
        if config.replica_view == "live":
            self.views = [SchedulerReplica(s) for s in self.schedulers]
        else:
            self.views = [PublishedReplica(s, count_sent=config.replica_view == "published+sent")
                          for s in self.schedulers]
        self.router = Router(self.views, config.router)

    def run(self, stop_if_missed: LatencyTarget | None = None) -> ClusterResult | None:
        """Simulate until every request has finished (or was rejected as never fitting).

        With `stop_if_missed`, stop and return None as soon as so many measured requests have
        exceeded a limit that the P99 can no longer meet it (a sizing probe that fails costs
        only the time until it is sure to fail).
        """
        requests = self.requests
        schedulers = self.schedulers
        router = self.router
        cost = self.cost_model
        block_size = self.config.scheduler.block_size
        num_requests = len(requests)
        first_token = [-1.0] * num_requests
        num_output = [0] * num_requests
        finish = [-1.0] * num_requests
        cached_tokens = [-1] * num_requests  # at first admission
        in_flight: list[tuple | None] = [None] * len(schedulers)  # replica -> (output, sampled) of its step
        events: list[tuple[float, int]] = []  # (step end, replica)
        num_rejected = num_prefill_tokens = num_steps = 0
        # Nearest-rank P99 <= limit  <=>  at most M - ceil(0.99 M) of the M measured requests exceed it.
        first_measured = int(self.config.warmup_fraction * num_requests)
        num_measured = num_requests - first_measured
        allowed_misses = num_measured - math.ceil(0.99 * num_measured)
        ttft_limit = e2e_limit = math.inf
        if stop_if_missed is not None:
            ttft_limit = stop_if_missed.p99_ttft_s or math.inf
            e2e_limit = stop_if_missed.p99_e2e_s or math.inf
        num_ttft_misses = num_e2e_misses = 0
        publish = self.config.replica_view != "live"

        def start_step(replica: int, now: float) -> None:
            nonlocal num_prefill_tokens, num_steps
            out = schedulers[replica].schedule()
            shape, sampled = fake_step(out, block_size)
            in_flight[replica] = (out, sampled)
            num_prefill_tokens += shape.prefill_tokens
            num_steps += 1
            heapq.heappush(events, (now + cost.step_time_s(shape.prefill_tokens, shape.decode_seqs, shape.kv_tokens,
                                                           shape.swapped_blocks * block_size), replica))

        next_arrival = 0
        while next_arrival < num_requests or events:
            if events and (next_arrival == num_requests or events[0][0] <= requests[next_arrival].arrival_s):
                now, replica = heapq.heappop(events)
                out, sampled = in_flight[replica]
                in_flight[replica] = None
                for item in out.scheduled:
                    seq_id = item.seq.seq_id
                    if cached_tokens[seq_id] < 0:
                        cached_tokens[seq_id] = item.seq.num_cached_tokens
                    if first_token[seq_id] < 0 and seq_id in sampled:
                        first_token[seq_id] = now
                        if now - requests[seq_id].arrival_s > ttft_limit and seq_id >= first_measured:
                            num_ttft_misses += 1
                scheduler = schedulers[replica]
                for seq in scheduler.update(out, sampled):
                    seq_id = seq.seq_id
                    finish[seq_id] = now
                    num_output[seq_id] = seq.num_output_tokens
                    if now - requests[seq_id].arrival_s > e2e_limit and seq_id >= first_measured:
                        num_e2e_misses += 1
                if num_ttft_misses > allowed_misses or num_e2e_misses > allowed_misses:
                    return None
                if publish:
                    self.views[replica].publish()
                if scheduler.has_unfinished():
                    start_step(replica, now)
                continue
            request = requests[next_arrival]
            replica = router.route(request.job.prompt_token_ids).replica
            if publish:
                self.views[replica].note_sent()
            try:
                schedulers[replica].add(job_sequence(request.job, next_arrival))
            except RequestRejectedError:
                num_rejected += 1
            else:
                if in_flight[replica] is None:
                    start_step(replica, request.arrival_s)
            next_arrival += 1
        return self._result(first_token, finish, cached_tokens, num_output, num_rejected, num_prefill_tokens,
                            num_steps)

    def _result(self, first_token, finish, cached_tokens, num_output, num_rejected, num_prefill_tokens,
                num_steps) -> ClusterResult:
        requests = self.requests
        start = int(self.config.warmup_fraction * len(requests))  # as in run()
        measured = [i for i in range(start, len(requests)) if finish[i] >= 0]
        prompt_tokens = sum(requests[i].job.num_prompt_tokens for i in measured)
        sim_time_s = max(finish, default=0.0)
        stats = self.router.stats
        return ClusterResult(
            policy=self.config.router.policy.value,
            num_replicas=self.config.num_replicas,
            num_requests=len(requests),
            num_measured=len(measured),
            num_rejected=num_rejected,
            sim_time_s=sim_time_s,
            offered_requests_per_s=len(requests) / requests[-1].arrival_s if requests[-1].arrival_s > 0 else 0.0,
            throughput_tokens_per_s=sum(num_output) / sim_time_s if sim_time_s > 0 else 0.0,
            throughput_requests_per_s=sum(1 for f in finish if f >= 0) / sim_time_s if sim_time_s > 0 else 0.0,
            ttft_p50_s=percentile([first_token[i] - requests[i].arrival_s for i in measured], 50),
            ttft_p99_s=percentile([first_token[i] - requests[i].arrival_s for i in measured], 99),
            e2e_p50_s=percentile([finish[i] - requests[i].arrival_s for i in measured], 50),
            e2e_p99_s=percentile([finish[i] - requests[i].arrival_s for i in measured], 99),
            prefix_hit_rate=sum(cached_tokens[i] for i in measured) / prompt_tokens if prompt_tokens else 0.0,
            num_prefill_tokens=num_prefill_tokens,
            num_preemptions=sum(s.stats.num_preemptions for s in self.schedulers),
            num_steps=num_steps,
            prefix_routed_share=stats.num_prefix / stats.num_routed,
            balanced_share=stats.num_balanced / stats.num_routed,
            max_replica_load=max(stats.num_per_replica) * len(stats.num_per_replica) / stats.num_routed,
        )


def simulate_cluster(config: ClusterConfig, requests: SequenceT[ChatRequest], cost_model: CostModel) -> ClusterResult:
    """Run one cluster simulation and return its metrics (see `ClusterSimulation`)."""
    return ClusterSimulation(config, requests, cost_model).run()


# ---------------------------------------------------------------------- sizing
@dataclass(frozen=True)
class SizingResult:
    """The fewest replicas found to meet a latency target at a workload's rate, and the runs that showed it."""

    policy: str
    target: str
    max_replicas: int
    num_replicas: int | None  # None: even max_replicas missed the target
    result: ClusterResult | None  # the run at num_replicas
    probes: tuple[tuple[int, bool], ...]  # (replicas, met) in the order tried

    def to_dict(self) -> dict:
        return {"policy": self.policy, "target": self.target, "max_replicas": self.max_replicas,
                "num_replicas": self.num_replicas, "result": self.result.to_dict() if self.result else None,
                "probes": [{"num_replicas": r, "met": met} for r, met in self.probes]}


def replicas_needed(config: ClusterConfig, requests: SequenceT[ChatRequest], cost_model: CostModel,
                    target: LatencyTarget, max_replicas: int) -> SizingResult:
    """The smallest replica count in [1, max_replicas] whose run meets `target` (`config.num_replicas` is ignored).

    Doubles from 1 until a run meets the target, then bisects between the last miss and that
    hit, so it assumes more replicas never raise the P99 (true up to routing noise). Runs
    that miss stop as soon as the miss is certain, so the search costs about two full runs
    plus a few partial ones.
    """
    require_positive_int("max_replicas", max_replicas)
    probes: list[tuple[int, bool]] = []
    results: dict[int, ClusterResult] = {}

    def meets(num_replicas: int) -> bool:
        run_config = dataclasses.replace(config, num_replicas=num_replicas)
        result = ClusterSimulation(run_config, requests, cost_model).run(stop_if_missed=target)
        met = result is not None and target.is_met(result)
        if met:
            results[num_replicas] = result
        probes.append((num_replicas, met))
        return met

    missed, met = 0, None
    num_replicas = 1
    while met is None:
        if meets(num_replicas):
            met = num_replicas
        elif num_replicas == max_replicas:
            return SizingResult(config.router.policy.value, target.describe(), max_replicas, None, None, tuple(probes))
        else:
            missed = num_replicas
            num_replicas = min(2 * num_replicas, max_replicas)
    while met - missed > 1:
        middle = (missed + met) // 2
        if meets(middle):
            met = middle
        else:
            missed = middle
    return SizingResult(config.router.policy.value, target.describe(), max_replicas, met, results[met], tuple(probes))


# ---------------------------------------------------------------------- many runs
@dataclass(frozen=True)
class ClusterTask:
    """One unit of work: a run at `config.num_replicas`, or (with `target`) a replica-count search."""

    config: ClusterConfig
    workload: ChatWorkload
    target: LatencyTarget | None = None
    max_replicas: int = 256


@functools.lru_cache(maxsize=4)
def _requests_of(workload: ChatWorkload) -> tuple[ChatRequest, ...]:
    # Each worker process builds a workload once, instead of unpickling thousands of prompts.
    return tuple(make_chat_requests(workload))


def run_task(task: ClusterTask, cost_model: CostModel) -> ClusterResult | SizingResult:
    """Do one task: a `ClusterResult` for a run, a `SizingResult` for a search."""
    requests = _requests_of(task.workload)
    if task.target is None:
        return simulate_cluster(task.config, requests, cost_model)
    return replicas_needed(task.config, requests, cost_model, task.target, task.max_replicas)


def run_tasks(tasks: SequenceT[ClusterTask], cost_model: CostModel, workers: int = 1,
              on_done: Callable[[int, ClusterResult | SizingResult], None] | None = None) -> list:
    """Every task's result, in task order, computed in `workers` processes (the same numbers for any count).

    `on_done(index, result)` is called in this process as each task finishes, in finishing order
    (a progress bar's hook).
    """
    results: list = [None] * len(tasks)

    def done(index: int, result) -> None:
        results[index] = result
        if on_done is not None:
            on_done(index, result)

    if workers <= 1 or len(tasks) <= 1:
        for index, task in enumerate(tasks):
            done(index, run_task(task, cost_model))
        return results
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks))) as pool:
        futures = {pool.submit(run_task, task, cost_model): index for index, task in enumerate(tasks)}
        for future in as_completed(futures):
            done(futures[future], future.result())
    return results
