"""The cluster simulator: its workload, replicas behind the real router, the sizing search, the CLI."""

import dataclasses
import json

import pytest

from pagedkv.cli import main
from pagedkv.distributed.router import RouterConfig
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import ConfigError
from pagedkv.sim import CostModel
from pagedkv.sim.chat_workload import ChatWorkload, arrival_times, make_chat_requests
from pagedkv.sim.simulator import job_sequence
from pagedkv.sim.cluster import (
    ClusterConfig,
    ClusterSimulation,
    LatencyTarget,
    PublishedReplica,
    percentile,
    replicas_needed,
    simulate_cluster,
)

COST = CostModel()
TINY = ChatWorkload(num_requests=240, rate_per_s=40.0, num_system_prompts=6, system_prompt_tokens=64,
                    min_user_tokens=4, max_user_tokens=24, min_output_tokens=4, max_output_tokens=24, seed=5)
SCHEDULER = SchedulerConfig(num_blocks=256, block_size=16, max_model_len=256, max_num_seqs=32,
                            max_num_batched_tokens=256)


def cluster(policy, num_replicas=4, **scheduler_changes):
    return ClusterConfig(num_replicas, dataclasses.replace(SCHEDULER, **scheduler_changes), RouterConfig(policy))


def test_workload_is_seeded_and_shares_system_prompts():
    requests = make_chat_requests(TINY)
    assert requests == make_chat_requests(TINY)
    assert requests != make_chat_requests(dataclasses.replace(TINY, seed=6))
    times = [r.arrival_s for r in requests]
    assert times == sorted(times) and times[0] > 0
    by_system = {}
    for request in requests:
        prompt = request.job.prompt_token_ids
        assert TINY.min_user_tokens <= len(prompt) - 64 <= TINY.max_user_tokens
        by_system.setdefault(request.system_prompt, set()).add(prompt[:64])
    assert all(len(prefixes) == 1 for prefixes in by_system.values())  # one system prompt, one prefix
    assert len({next(iter(p)) for p in by_system.values()}) == len(by_system)  # and distinct ones
    counts = [sum(1 for r in requests if r.system_prompt == k) for k in range(TINY.num_system_prompts)]
    assert counts[0] == max(counts) and counts[0] > 2 * counts[-1]  # Zipf: the first is the most popular


def test_arrival_processes_keep_the_mean_rate_and_bursty_is_burstier():
    for arrival, tolerance in (("poisson", 0.05), ("bursty", 0.15)):  # ~120 burst cycles: a looser mean
        times = arrival_times(dataclasses.replace(TINY, num_requests=60_000, rate_per_s=100.0, arrival=arrival))
        assert times == sorted(times)
        assert len(times) / times[-1] == pytest.approx(100.0, rel=tolerance)
        bins = [0] * int(times[-1])  # whole seconds only
        for t in times:
            if t < len(bins):
                bins[int(t)] += 1
        mean = sum(bins) / len(bins)
        dispersion = sum((c - mean) ** 2 for c in bins) / len(bins) / mean
        if arrival == "poisson":
            assert 0.8 < dispersion < 1.2  # Poisson counts: variance = mean
        else:
            assert dispersion > 5  # bursts at 3x the mean rate for 20% of the time


def test_workload_config_errors():
    with pytest.raises(ConfigError, match="arrival"):
        ChatWorkload(arrival="uniform")
    with pytest.raises(ConfigError, match="burst_factor"):
        ChatWorkload(burst_factor=5.0, burst_fraction=0.2)
    with pytest.raises(ConfigError, match="max_user_tokens"):
        ChatWorkload(min_user_tokens=10, max_user_tokens=5)


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) == 0.0


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix"])
def test_every_request_finishes_and_no_blocks_leak(policy):
    requests = make_chat_requests(dataclasses.replace(TINY, rate_per_s=400.0))
    sim = ClusterSimulation(cluster(policy, num_blocks=24, watermark=0.0), requests, COST)
    result = sim.run()
    assert result.num_rejected == 0 and result.num_measured == len(requests) - int(0.2 * len(requests))
    expected = sum(r.job.num_output_tokens for r in requests)
    assert result.throughput_tokens_per_s * result.sim_time_s == pytest.approx(expected)
    assert result.num_preemptions > 0, "24-block replicas under load should preempt"
    for scheduler in sim.schedulers:
        assert not scheduler.has_unfinished()
        scheduler.check_integrity()
        assert scheduler.block_manager.num_used_blocks == 0
    assert sum(sim.router.stats.num_per_replica) == len(requests)


def test_same_seed_same_result_and_prefix_routing_hits_more():
    requests = make_chat_requests(TINY)
    first = simulate_cluster(cluster("prefix", 6), requests, COST)
    assert first == simulate_cluster(cluster("prefix", 6), make_chat_requests(TINY), COST)
    round_robin = simulate_cluster(cluster("round_robin", 6), requests, COST)
    assert first.prefix_hit_rate > round_robin.prefix_hit_rate
    assert first.num_prefill_tokens < round_robin.num_prefill_tokens
    assert first.prefix_routed_share > 0.5 and round_robin.prefix_routed_share == 0.0
    assert 0 < first.ttft_p50_s <= first.ttft_p99_s < first.e2e_p99_s


def test_published_view_lags_the_scheduler_and_prefix_routing_still_hits_by_memory():
    requests = make_chat_requests(TINY)
    view, counting = PublishedReplica(Scheduler(SCHEDULER)), PublishedReplica(Scheduler(SCHEDULER), count_sent=True)
    for replica in (view, counting):
        replica.scheduler.add(job_sequence(requests[0].job, 0))
        replica.note_sent()
    assert (view.num_waiting, view.num_cached_blocks([b"x" * 32])) == (0, 0)  # routed since the last step
    assert counting.num_waiting == 1
    for replica in (view, counting):
        replica.publish()
        assert replica.num_waiting == 1
    published = dataclasses.replace(cluster("prefix", 6), replica_view="published")
    result = simulate_cluster(published, requests, COST)
    round_robin = simulate_cluster(dataclasses.replace(cluster("round_robin", 6), replica_view="published"), requests,
                                   COST)
    assert result.num_measured == round_robin.num_measured > 0
    assert result.prefix_hit_rate > round_robin.prefix_hit_rate and result.prefix_routed_share > 0.5
    with pytest.raises(ConfigError, match="replica_view"):
        dataclasses.replace(published, replica_view="remote")


def test_sizing_finds_the_smallest_cluster_that_meets_the_target():
    requests = make_chat_requests(dataclasses.replace(TINY, rate_per_s=120.0))
    config = cluster("least_loaded", 1, max_num_seqs=8)
    overloaded = ClusterSimulation(dataclasses.replace(config, num_replicas=1), requests, COST).run()
    target = LatencyTarget(p99_ttft_s=overloaded.ttft_p99_s / 10)
    sizing = replicas_needed(config, requests, COST, target, max_replicas=16)
    assert sizing.num_replicas is not None and sizing.num_replicas > 1
    assert target.is_met(sizing.result) and sizing.result.num_replicas == sizing.num_replicas
    below = dataclasses.replace(config, num_replicas=sizing.num_replicas - 1)
    assert not target.is_met(simulate_cluster(below, requests, COST))
    assert ClusterSimulation(below, requests, COST).run(stop_if_missed=target) is None
    assert (sizing.num_replicas, True) in sizing.probes and (1, False) in sizing.probes
    impossible = replicas_needed(config, requests, COST, LatencyTarget(p99_e2e_s=1e-4), max_replicas=2)
    assert impossible.num_replicas is None and impossible.probes == ((1, False), (2, False))


CLI_SMALL = ["--cluster", "--rate", "40", "--requests", "160", "--replicas", "3", "--system-prompts", "5",
             "--system-prompt-len", "64", "--user-tokens", "4,24", "--output-tokens", "4,24", "--replica-blocks",
             "256", "--max-model-len", "256", "--max-replicas", "4", "--p99-ttft", "0.5", "--p99-e2e", "5",
             "--arrival", "both"]


def test_cli_cluster_is_deterministic_and_writes_results(tmp_path, capsys):
    args = ["sim", *CLI_SMALL, "--out", str(tmp_path), "--tag", "t", "--workers", "1"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert "| poisson | round_robin | 3 |" in first and "| bursty | prefix |" in first and "Replicas needed" in first
    payload = json.loads((tmp_path / "cluster_t.json").read_text())
    assert [(r["arrival"], r["policy"]) for r in payload["comparison"]] == [
        (a, p) for a in ("poisson", "bursty") for p in ("round_robin", "least_loaded", "prefix")]
    assert len(payload["sizing"]) == 6 and "commit" in payload["provenance"]
    assert (tmp_path / "cluster_t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Routing policies" in (tmp_path / "cluster_t.md").read_text()


@pytest.mark.parametrize("bad,needle", [
    (["--arrival", "uniform"], "--arrival"),
    (["--policy", "random"], "--policy"),
    (["--replicas", "0"], "--replicas"),
    (["--user-tokens", "4"], "MIN,MAX"),
    (["--max-model-len", "64"], "--max-model-len"),
])
def test_cli_cluster_bad_input_is_one_line_exit_2(bad, needle, tmp_path, capsys):
    assert main(["sim", *CLI_SMALL, "--out", str(tmp_path), *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv: error: ") and needle in err and err.count("\n") == 1
