"""Prometheus metrics of one server, in their own `CollectorRegistry`.

Each app owns a registry (not prometheus_client's global one), so several apps can live in
one process, as they do in the tests. Gauges and the counters that mirror `EngineStats` are
written only by the engine thread, after each step, from the engine's own numbers: counters
move by the delta since the last step, so they always agree with `LLMEngine.stats()`.
Latency histograms are observed when a request finishes, from the server's clock (arrival
is when the HTTP handler received the request, so queueing to the engine thread counts).
The HTTP counters (responses, rejections, aborts) are written by whichever thread sees the
event; prometheus_client's counters are thread-safe.

    pagedkv_num_requests_running / _waiting / _swapped   gauges (requests, not sequences)
    pagedkv_kv_cache_usage                              gauge, fraction of KV blocks in use
    pagedkv_kv_cache_used_blocks / _total_blocks        gauges
    pagedkv_num_preemptions_total                       counter
    pagedkv_swap_outs_total / pagedkv_swap_ins_total    counters (blocks' sequences swapped)
    pagedkv_prefix_cache_queries_total / _hits_total    counters (blocks looked up / found)
    pagedkv_prefix_cache_hit_tokens_total               counter
    pagedkv_prompt_tokens_total                         counter (prompt tokens computed)
    pagedkv_generation_tokens_total                     counter
    pagedkv_request_failures_total                      counter: requests the engine failed alone
    pagedkv_kv_{gpu,host,disk}_hit_blocks_total         counters: prompt blocks served per KV tier
    pagedkv_kv_offloaded_blocks_total, _disk_*          counters: spills, disk writes and bad files
    pagedkv_kv_{device_to_host,host_to_device}_{bytes,seconds}_total, pagedkv_kv_disk_{read,write}_*
    pagedkv_request_success_total{finished_reason}      counter
    pagedkv_time_to_first_token_seconds                 histogram
    pagedkv_time_per_output_token_seconds               histogram
    pagedkv_e2e_request_latency_seconds                 histogram
    pagedkv_request_aborted_total{reason}               counter: client_disconnected, timeout, error, shutdown
    pagedkv_request_rejected_total{reason}              counter: the error code of a 4xx/503 refusal
    pagedkv_http_responses_total{status}                counter
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
                 120.0, 300.0)

#: counter name -> `EngineStats` field it mirrors
_MIRRORED = {
    "pagedkv_num_preemptions": ("num_preemptions", "Preemptions (recompute or swap) since the server started."),
    "pagedkv_swap_outs": ("num_swap_outs", "Sequences swapped out to host memory."),
    "pagedkv_swap_ins": ("num_swap_ins", "Sequences swapped back in from host memory."),
    "pagedkv_prefix_cache_queries": ("prefix_cache_queries", "Prefix-cache lookups, in blocks."),
    "pagedkv_prefix_cache_hits": ("prefix_cache_hits", "Prefix-cache hits, in blocks."),
    "pagedkv_prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."),
    "pagedkv_prompt_tokens": ("num_prompt_tokens", "Prompt tokens computed (prefill)."),
    "pagedkv_generation_tokens": ("num_generated_tokens", "Tokens generated."),
    "pagedkv_request_failures": ("num_request_failures", "Requests that failed alone inside the engine "
                                                         "(resolve, sampling, detokenization); their step-mates went on."),
    # KV tiers (docs/kv-tiers.md): prefix blocks served per tier, blocks and bytes moved, copy time
    "pagedkv_kv_gpu_hit_blocks": ("kv_gpu_hit_blocks", "Prompt blocks served by the GPU prefix cache (KV tiers on)."),
    "pagedkv_kv_host_hit_blocks": ("kv_host_hit_blocks", "Prompt blocks restored from the host tier."),
    "pagedkv_kv_disk_hit_blocks": ("kv_disk_hit_blocks", "Prompt blocks restored from the disk tier."),
    "pagedkv_kv_offloaded_blocks": ("kv_offloaded_blocks", "Blocks the GPU prefix cache spilled to the host tier."),
    "pagedkv_kv_disk_load_misses": ("kv_disk_load_misses", "Disk-tier files found torn, corrupt or foreign."),
    "pagedkv_kv_disk_written_blocks": ("kv_disk_written_blocks", "Blocks written to the disk tier."),
    "pagedkv_kv_device_to_host_bytes": ("kv_d2h_bytes", "Bytes copied device to host (spills, swap-outs)."),
    "pagedkv_kv_host_to_device_bytes": ("kv_h2d_bytes", "Bytes copied host to device (restores, swap-ins)."),
    "pagedkv_kv_device_to_host_seconds": ("kv_d2h_seconds", "Device time of device-to-host KV copies."),
    "pagedkv_kv_host_to_device_seconds": ("kv_h2d_seconds", "Device time of host-to-device KV copies."),
    "pagedkv_kv_host_to_device_copy_seconds": ("kv_h2d_copy_seconds",
                                               "Device time of host-to-device KV copies, without the scatter."),
    "pagedkv_kv_disk_read_bytes": ("kv_disk_read_bytes", "Bytes read from the disk tier."),
    "pagedkv_kv_disk_read_seconds": ("kv_disk_read_seconds", "Time spent reading the disk tier."),
    "pagedkv_kv_disk_write_bytes": ("kv_disk_write_bytes", "Bytes queued for writing to the disk tier."),
}


class ServerMetrics:
    """The server's metrics. `update_from_engine` and `observe_request` run where the engine is driven: its
    thread, or the event loop for an engine on it (`LoopAsyncEngine`)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        gauge = self._gauge
        self.num_requests_running = gauge("pagedkv_num_requests_running", "Requests with sequences running.")
        self.num_requests_waiting = gauge("pagedkv_num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("pagedkv_num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_cache_usage = gauge("pagedkv_kv_cache_usage", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_cache_used_blocks = gauge("pagedkv_kv_cache_used_blocks", "KV-cache blocks in use.")
        self.kv_cache_total_blocks = gauge("pagedkv_kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self._mirrored = {stat: Counter(name, doc, registry=self.registry)
                          for name, (stat, doc) in _MIRRORED.items()}
        self.request_success = Counter("pagedkv_request_success", "Requests finished, by finish reason.",
                                       ["finished_reason"], registry=self.registry)
        self.time_to_first_token = Histogram("pagedkv_time_to_first_token_seconds", "Time to first token.",
                                             buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.time_per_output_token = Histogram("pagedkv_time_per_output_token_seconds",
                                               "Mean time per output token after the first, per request.",
                                               buckets=TPOT_BUCKETS_S, registry=self.registry)
        self.e2e_request_latency = Histogram("pagedkv_e2e_request_latency_seconds", "End-to-end request latency.",
                                             buckets=E2E_BUCKETS_S, registry=self.registry)
        self.request_aborted = Counter("pagedkv_request_aborted", "Engine requests ended before they finished, "
                                       "by reason.", ["reason"], registry=self.registry)
        self.request_rejected = Counter("pagedkv_request_rejected", "HTTP requests refused before reaching the "
                                        "engine, by error code.", ["reason"], registry=self.registry)
        self.http_responses = Counter("pagedkv_http_responses", "HTTP responses, by status code.", ["status"],
                                      registry=self.registry)
        self._replica_gauges()
        self._last: dict[str, int] | None = None

    def _replica_gauges(self) -> None:
        self.replica_alive = Gauge("pagedkv_replica_alive", "1 while a data-parallel replica runs.", ["replica"],
                                   registry=self.registry)
        self.replica_waiting = Gauge("pagedkv_replica_num_requests_waiting", "Requests waiting, per replica.",
                                     ["replica"], registry=self.registry)
        self.replica_running = Gauge("pagedkv_replica_num_requests_running", "Requests running, per replica.",
                                     ["replica"], registry=self.registry)
        self.replica_free_blocks = Gauge("pagedkv_replica_kv_cache_free_blocks", "Free KV blocks, per replica.",
                                         ["replica"], registry=self.registry)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, registry=self.registry)

    def update_from_engine(self, engine) -> None:
        """Set the gauges and move the mirrored counters by what the engine counted since the last call.

        The first call only records a baseline, so an engine that already ran offline starts at zero.
        """
        stats = engine.latest_stats()  # data parallel: the replicas' pushed stats (asking would wait on a step)
        for replica in engine.health() or ():  # data-parallel replicas, labelled
            label = str(replica["replica"])
            self.replica_alive.labels(replica=label).set(1 if replica["alive"] else 0)
            self.replica_waiting.labels(replica=label).set(replica["waiting"])
            self.replica_running.labels(replica=label).set(replica["running"])
            self.replica_free_blocks.labels(replica=label).set(replica["free_blocks"])
        queues = engine.queue_sizes()
        self.num_requests_running.set(queues.num_running)
        self.num_requests_waiting.set(queues.num_waiting)
        self.num_requests_swapped.set(queues.num_swapped)
        self.kv_cache_used_blocks.set(stats.num_used_blocks)
        self.kv_cache_total_blocks.set(stats.num_blocks)
        self.kv_cache_usage.set(stats.num_used_blocks / stats.num_blocks)
        current = {stat: getattr(stats, stat) for stat in self._mirrored}
        if self._last is not None:
            for stat, counter in self._mirrored.items():
                delta = current[stat] - self._last[stat]
                if delta > 0:
                    counter.inc(delta)
        self._last = current

    def observe_request(self, arrival_s: float, first_token_s: float | None, finish_s: float,
                        num_output_tokens: int, finish_reason: str) -> None:
        """Latencies of one finished request (perf_counter seconds)."""
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e_request_latency.observe(finish_s - arrival_s)
        if first_token_s is not None:
            self.time_to_first_token.observe(first_token_s - arrival_s)
            if num_output_tokens > 1:
                self.time_per_output_token.observe((finish_s - first_token_s) / (num_output_tokens - 1))

    def observe_abort(self, reason: str, count: int = 1) -> None:
        """`count` engine requests ended early: client_disconnected, timeout, error or shutdown."""
        if count:
            self.request_aborted.labels(reason=reason).inc(count)

    def observe_rejection(self, reason: str) -> None:
        """An HTTP request refused before reaching the engine (`reason`: its error code)."""
        self.request_rejected.labels(reason=reason).inc()

    def observe_response(self, status: int) -> None:
        self.http_responses.labels(status=str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
