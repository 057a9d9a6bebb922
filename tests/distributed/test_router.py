"""The data-parallel router: prefix matches by the engine's block hashes, ties and misses by load, the guards."""

import threading

import pytest

from pagedkv.core.prefix_cache import hash_blocks
from pagedkv.distributed.router import (
    NoReplicaAvailableError,
    Router,
    RouterConfig,
    RoutingPolicy,
    SchedulerReplica,
)
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.engine.sequence import Sequence
from pagedkv.errors import ConfigError, InvalidArgumentError

BLOCK_SIZE = 4


class FakeReplica:
    """A replica whose cache holds the leading blocks of given prompts, with set load."""

    def __init__(self, num_waiting=0, num_free_blocks=100, cached_prompts=(), block_size=BLOCK_SIZE, num_running=0):
        self.block_size = block_size
        self.num_waiting = num_waiting
        self.num_running = num_running
        self.num_free_blocks = num_free_blocks
        self.cached = set()
        for prompt in cached_prompts:
            self.cached.update(hash_blocks(prompt, block_size))

    def num_cached_blocks(self, block_hashes):
        count = 0
        for key in block_hashes:
            if key not in self.cached:
                break
            count += 1
        return count


def prompt(first, num_tokens):
    return list(range(first, first + num_tokens))


SYSTEM = prompt(1000, 4 * BLOCK_SIZE)  # four full blocks
REQUEST = SYSTEM + prompt(5000, 6)  # the system prompt, then a user part: 5 full blocks + 2 tokens


def test_longest_cached_prefix_wins_over_load():
    replicas = [FakeReplica(num_waiting=0), FakeReplica(num_waiting=2, cached_prompts=[SYSTEM[:8]]),
                FakeReplica(num_waiting=3, cached_prompts=[SYSTEM])]
    decision = Router(replicas).route(REQUEST)
    assert (decision.replica, decision.num_matched_blocks, decision.num_prompt_blocks) == (2, 4, 5)
    assert decision.reason == "prefix"


def test_tied_matches_go_to_fewest_waiting_then_most_free_blocks_then_lowest_index():
    router = Router([FakeReplica(num_waiting=1, cached_prompts=[SYSTEM]),
                     FakeReplica(num_waiting=0, num_free_blocks=10, cached_prompts=[SYSTEM]),
                     FakeReplica(num_waiting=0, num_free_blocks=50, cached_prompts=[SYSTEM]),
                     FakeReplica(num_waiting=0, num_free_blocks=50, cached_prompts=[SYSTEM]),
                     FakeReplica(num_waiting=0, num_free_blocks=99)])
    decision = router.route(REQUEST)
    assert (decision.replica, decision.reason, decision.num_matched_blocks) == (2, "prefix", 4)


def test_a_miss_goes_to_the_least_loaded_replica():
    replicas = [FakeReplica(num_waiting=2, num_free_blocks=100), FakeReplica(num_waiting=1, num_free_blocks=5),
                FakeReplica(num_waiting=1, num_free_blocks=40), FakeReplica(num_waiting=0, cached_prompts=[SYSTEM])]
    decision = Router(replicas).route(prompt(7000, 20))  # shares nothing with SYSTEM
    assert (decision.replica, decision.reason, decision.num_matched_blocks) == (3, "least_loaded", 0)
    replicas[3].num_waiting = 5
    assert Router(replicas).route(prompt(7000, 20)).replica == 2


def test_least_loaded_policy_ignores_the_cache():
    replicas = [FakeReplica(num_waiting=3, cached_prompts=[SYSTEM]), FakeReplica(num_waiting=1)]
    decision = Router(replicas, RouterConfig(policy="least_loaded")).route(REQUEST)
    assert (decision.replica, decision.reason) == (1, "least_loaded")


def test_round_robin_cycles_and_skips_excluded_replicas():
    router = Router([FakeReplica() for _ in range(3)], RouterConfig(policy=RoutingPolicy.ROUND_ROBIN))
    assert [router.route(REQUEST).replica for _ in range(4)] == [0, 1, 2, 0]
    assert router.route(REQUEST, exclude={1}).replica == 2
    assert router.route(REQUEST).replica == 0
    assert router.stats.num_per_replica == [3, 1, 2]


def test_excluded_replicas_are_never_chosen_and_all_excluded_raises_without_change():
    replicas = [FakeReplica(cached_prompts=[SYSTEM]), FakeReplica(num_waiting=4), FakeReplica(num_waiting=1)]
    router = Router(replicas)
    assert router.route(REQUEST, exclude={0}).replica == 2
    with pytest.raises(NoReplicaAvailableError, match="all 3 replicas"):
        router.route(REQUEST, exclude={0, 1, 2})
    assert router.stats.num_routed == 1


def test_memory_sends_a_prefix_being_prefilled_to_the_same_replica():
    replicas = [FakeReplica(num_free_blocks=50), FakeReplica(num_free_blocks=60)]
    router = Router(replicas)
    first = router.route(REQUEST)
    assert (first.replica, first.reason) == (1, "least_loaded")
    replicas[1].num_free_blocks = 40  # replica 1 admitted it but has not cached the prefix yet
    second = router.route(SYSTEM + prompt(9000, 7))
    assert (second.replica, second.reason, second.num_matched_blocks) == (1, "prefix", 4)
    forgetful = Router(replicas, RouterConfig(max_remembered_blocks=0))
    forgetful.route(REQUEST)
    assert forgetful.route(SYSTEM + prompt(9000, 7)).replica == 0


def test_memory_is_bounded_and_keeps_leading_blocks():
    router = Router([FakeReplica(num_free_blocks=50), FakeReplica(num_free_blocks=60)],
                    RouterConfig(max_remembered_blocks=3))
    router.route(REQUEST)
    assert len(router._remembered) == 3
    router.replicas[1].num_free_blocks = 40
    assert router.route(SYSTEM + prompt(9000, 7)).num_matched_blocks == 3


def test_balance_guard_moves_a_match_off_an_overloaded_replica():
    # In flight (waiting + running): 0, 3, 5.
    replicas = [FakeReplica(num_waiting=0), FakeReplica(num_waiting=1, num_running=2, cached_prompts=[SYSTEM[:8]]),
                FakeReplica(num_waiting=1, num_running=4, cached_prompts=[SYSTEM])]
    decision = Router(replicas, RouterConfig(balance_threshold=4)).route(REQUEST)
    assert (decision.replica, decision.reason, decision.num_matched_blocks) == (1, "balance", 2)
    replicas[1].num_running = 5
    decision = Router(replicas, RouterConfig(balance_threshold=4)).route(REQUEST)
    assert (decision.replica, decision.reason, decision.num_matched_blocks) == (0, "balance", 0)
    assert Router(replicas, RouterConfig(balance_threshold=None)).route(REQUEST).replica == 2
    assert Router(replicas, RouterConfig(balance_threshold=5)).route(REQUEST).replica == 2


def test_the_default_guard_tolerates_32_more_requests_in_flight():
    replicas = [FakeReplica(num_running=10), FakeReplica(num_running=42, cached_prompts=[SYSTEM])]
    assert Router(replicas).route(REQUEST).replica == 1
    replicas[1].num_running = 43
    assert Router(replicas).route(REQUEST).replica == 0


def test_router_hashes_like_the_engine_and_finds_a_scheduler_prefix():
    schedulers = [Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE)) for _ in range(3)]
    warm = schedulers[1]
    warm.add(Sequence(0, "warm", list(REQUEST), SamplingParams(max_tokens=2, ignore_eos=True), arrival_index=0))
    out = warm.schedule()
    warm.update(out, {0: 7})
    router = Router([SchedulerReplica(s) for s in schedulers])
    follow_up = SYSTEM + prompt(9000, 9)
    hits, _ = warm.block_manager.match_prefix(follow_up)
    decision = router.route(follow_up)
    assert (decision.replica, decision.num_matched_blocks) == (1, len(hits)) and len(hits) == 4
    # A prompt of exactly k blocks can hit k - 1 (the last token is always computed), as in the engine.
    assert len(router.prompt_block_hashes(SYSTEM)) == 3
    _, engine_keys = warm.block_manager.match_prefix(follow_up)
    assert router.prompt_block_hashes(follow_up) == engine_keys[:(len(follow_up) - 1) // BLOCK_SIZE]
    warm.check_integrity()


def test_config_errors():
    with pytest.raises(ConfigError, match="block size"):
        Router([FakeReplica(block_size=4), FakeReplica(block_size=8)])
    with pytest.raises(ConfigError, match="random"):
        RouterConfig(policy="random")
    with pytest.raises(InvalidArgumentError, match="balance_threshold"):
        RouterConfig(balance_threshold=-1)


def test_concurrent_routing_keeps_round_robin_exact():
    router = Router([FakeReplica() for _ in range(4)], RouterConfig(policy="round_robin"))

    def work():
        for _ in range(200):
            router.route(REQUEST)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert router.stats.num_per_replica == [200, 200, 200, 200]
