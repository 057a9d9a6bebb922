"""Layer groups: sliding-window groups keep only their window, per-group prefix caching, preemption.

The scheduler scenarios drive the engine's own `Scheduler` with fake tokens, as the simulator does.
"""

import math

import pytest

from pagedkv.core.block_manager import KVBlockManager
from pagedkv.core.hybrid_block_manager import HybridBlockManager
from pagedkv.core.kv_groups import FULL_ATTENTION as FULL, SLIDING_ATTENTION as SLIDE, group_layers
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.engine.sequence import Sequence
from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.sim.simulator import fake_step

BLOCK = 4
WINDOW = 10
# Gemma-like: 2 sliding layers per full one -> groups of 2 slots: 1 full group, 2 sliding groups.
LAYER_TYPES = (SLIDE, SLIDE, FULL, SLIDE, SLIDE, FULL)
LAYOUT = group_layers(LAYER_TYPES, WINDOW, bytes_per_token_per_layer=64)
DECODE_BOUND = math.ceil(WINDOW / BLOCK) + 1  # the bound: ceil(W / B) + 1
BETWEEN_STEPS_BOUND = math.ceil((WINDOW - 1) / BLOCK) + 1


def chunk_bound(num_query_tokens: int) -> int:
    """Blocks a step of C query tokens may hold in a sliding group: its keys span W + C - 1 tokens."""
    return math.ceil((WINDOW + num_query_tokens - 2) / BLOCK) + 1


def test_group_layers_splits_types_into_equal_pages():
    assert LAYOUT.num_groups == 3 and LAYOUT.num_slots == 2
    assert [g.sliding_window for g in LAYOUT.groups] == [None, WINDOW, WINDOW]
    assert LAYOUT.layer_group == (1, 1, 0, 2, 2, 0)
    assert LAYOUT.layer_slot == (0, 1, 0, 0, 1, 1)
    assert {g.page_size_bytes(BLOCK) for g in LAYOUT.groups} == {BLOCK * 2 * 64}
    one = group_layers((FULL,) * 5, None, bytes_per_token_per_layer=64)
    assert one.num_groups == 1 and one.num_slots == 5 and not one.is_hybrid
    with pytest.raises(ConfigError, match="attention type"):
        group_layers((FULL, "linear_attention"), None, bytes_per_token_per_layer=64)
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        group_layers((FULL, SLIDE), None, bytes_per_token_per_layer=64)


def test_models_without_sliding_layers_keep_the_one_table_manager():
    one = group_layers((FULL,) * 4, None, bytes_per_token_per_layer=64)
    assert type(Scheduler(SchedulerConfig(num_blocks=8, kv_layout=one)).block_manager) is KVBlockManager
    assert type(Scheduler(SchedulerConfig(num_blocks=8, kv_layout=LAYOUT)).block_manager) is HybridBlockManager
    with pytest.raises(ConfigError, match="naive"):
        SchedulerConfig(num_blocks=8, kv_layout=LAYOUT, reservation="naive")


def _sliding_held(bm: HybridBlockManager, seq_id: int) -> list[int]:
    return [bm.num_held_blocks(seq_id, g) for g, group in enumerate(bm.groups) if group.is_sliding]


def _run(config: SchedulerConfig, seqs: list[Sequence], check_step=None) -> Scheduler:
    """Run every sequence to its end through the real scheduler (fake tokens), checking integrity each step."""
    scheduler = Scheduler(config)
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        if check_step is not None:
            check_step(scheduler, out, "scheduled")
        _, sampled = fake_step(out, config.block_size)
        scheduler.update(out, sampled)
        if check_step is not None:
            check_step(scheduler, out, "updated")
        scheduler.check_integrity()
        steps += 1
        assert steps < 20_000
    return scheduler


def _seqs(num: int, prompt_len: int, max_tokens: int, shared_prefix: int = 0, n: int = 1) -> list[Sequence]:
    seqs = []
    for i in range(num):
        prompt = list(range(1, shared_prefix + 1)) + [100 + (i * 31 + t) % 400 for t in range(prompt_len - shared_prefix)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
        seqs.append(Sequence(i, f"r{i}", prompt, params, arrival_index=i))
    return seqs


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_sliding_groups_hold_only_their_window_and_return_every_block(enable_prefix_caching):
    """64 sequences of 8x the window: the bound holds at every step, and the pool is empty after the run."""
    peak = {"decode": 0, "between": 0}

    def check(scheduler, out, phase):
        bm = scheduler.block_manager
        if phase == "scheduled":
            for item in out.scheduled:
                held = _sliding_held(bm, item.seq.seq_id)
                assert max(held) <= chunk_bound(item.num_new_tokens), (item.num_new_tokens, held)
                if item.is_decode:
                    assert max(held) <= DECODE_BOUND, held
                    peak["decode"] = max(peak["decode"], *held)
        else:
            for seq in scheduler.running:
                held = _sliding_held(bm, seq.seq_id)
                assert max(held) <= BETWEEN_STEPS_BOUND, held
                peak["between"] = max(peak["between"], *held)

    config = SchedulerConfig(num_blocks=4096, block_size=BLOCK, max_model_len=8 * WINDOW, max_num_seqs=64,
                             max_num_batched_tokens=256, kv_layout=LAYOUT,
                             enable_prefix_caching=enable_prefix_caching)
    scheduler = _run(config, _seqs(64, WINDOW, 7 * WINDOW), check)
    bm = scheduler.block_manager
    assert peak["decode"] == BETWEEN_STEPS_BOUND <= DECODE_BOUND  # reached: the check is tight
    assert peak["between"] == BETWEEN_STEPS_BOUND - 1  # W - 1 computed keys of the window: one block fewer here
    assert bm.num_used_blocks == 0
    if enable_prefix_caching:  # what stays is cached, evictable KV: every full block of every sequence, per group
        assert all(cache.num_cached == cache.num_evictable == 64 * ((8 * WINDOW - 1) // BLOCK) for cache in bm.caches)
    else:
        assert bm.allocator.num_used == 0


def test_prefix_hit_needs_the_whole_prefix_in_full_groups_and_the_window_in_sliding_groups():
    bm = HybridBlockManager(LAYOUT, 64, BLOCK, max_query_tokens=64)
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks
    assert bm.admit(0, prompt) == 0
    bm.schedule(0, 0, len(prompt))
    bm.commit(0, prompt, len(prompt))
    bm.release_out_of_window(0, len(prompt))
    first_live = (len(prompt) - WINDOW + 1) // BLOCK  # 5: blocks 0..4 are out of every later window
    sliding = [g for g, group in enumerate(LAYOUT.groups) if group.is_sliding]
    for g in sliding:
        assert bm.group_table(0, g).num_dropped == first_live
    hit_window = (7 * BLOCK - WINDOW + 1) // BLOCK  # 4: the first block a query at position 28 reads
    full_blocks = list(bm.group_table(0, 0).block_ids[:7])
    held_before = {g: bm.group_table(0, g).block_ids[first_live:7] for g in sliding}
    bm.free(0)
    bm.check_integrity()
    assert [cache.num_cached for cache in bm.caches] == [7, 7, 7]  # every full block, in every group
    assert bm.num_used_blocks == 0

    # Same prompt: a hit of 7 blocks (the last prompt token is always computed); sliding groups share blocks
    # 4..6 (block 4 had left the first sequence's window, but stayed cached).
    assert bm.admit(1, prompt) == 7 * BLOCK
    assert bm.group_table(1, 0).block_ids == full_blocks
    for g in sliding:
        table = bm.group_table(1, g)
        assert table.block_ids[:hit_window] == [bm.null_block] * hit_window
        assert table.block_ids[first_live:] == held_before[g] and table.num_held == 7 - hit_window
    bm.check_integrity()
    bm.free(1)

    # Blocks before the window may be evicted without losing the hit; one window block may not.
    for g in sliding:
        assert bm.caches[g].evict(hit_window) == hit_window  # the LRU blocks: 0..3, dropped first
    assert bm.admit(2, prompt) == 7 * BLOCK
    bm.free(2)
    bm.caches[sliding[0]].evict(1)  # block 4 of one sliding group
    assert bm.admit(3, prompt) == 0  # no shorter hit has its window cached either
    assert bm.group_table(3, 0).block_ids == []
    bm.free(3)
    bm.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_per_group_frees_and_restores_every_group(mode):
    """A pool too small for the batch: victims are preempted (recompute or swap) and every request still ends."""
    stats = {"swapped_in_with_dropped": 0}

    def check(scheduler, out, phase):
        bm = scheduler.block_manager
        if phase == "scheduled" and out.swap_in:
            for seq in scheduler.running:
                sliding = [g for g, group in enumerate(bm.groups) if group.is_sliding]
                stats["swapped_in_with_dropped"] += any(bm.group_table(seq.seq_id, g).num_dropped for g in sliding)

    config = SchedulerConfig(num_blocks=90, block_size=BLOCK, max_model_len=8 * WINDOW, max_num_seqs=16,
                             max_num_batched_tokens=64, kv_layout=LAYOUT, preemption_mode=mode,
                             num_swap_blocks=200 if mode == "swap" else 0)
    seqs = _seqs(16, WINDOW, 7 * WINDOW, shared_prefix=8)
    scheduler = _run(config, seqs, check)
    assert scheduler.stats.num_preemptions > 0
    if mode == "swap":
        assert scheduler.stats.num_swap_ins > 0 and stats["swapped_in_with_dropped"] > 0
        scheduler.block_manager.begin_step()  # the last swap-in's host blocks are free from the next step
        assert scheduler.block_manager.tiers.host.allocator.num_used == 0
    assert all(len(seq.output_token_ids) == 7 * WINDOW for seq in seqs)
    assert scheduler.block_manager.num_used_blocks == 0


def test_swap_out_keeps_only_the_window_and_swap_in_restores_positions():
    bm = HybridBlockManager(LAYOUT, 64, BLOCK, num_swap_blocks=64, max_query_tokens=64)
    prompt = list(range(1, 31))
    bm.admit(0, prompt)
    bm.schedule(0, 0, 30)
    bm.commit(0, prompt, 30)
    bm.release_out_of_window(0, 30)
    held = sum(bm.num_held_blocks(0, g) for g in range(LAYOUT.num_groups))
    assert held == 8 + 2 * 3  # full: 8 blocks; sliding: blocks 5, 6, 7
    out_copies = bm.swap_out(0)
    assert len(out_copies) == held and bm.num_used_blocks == 0
    in_copies = bm.swap_in(0)
    assert [c.src for c in in_copies] == [c.dst for c in out_copies]
    for g in (1, 2):
        table = bm.group_table(0, g)
        assert (table.num_tokens, table.num_dropped, len(table.block_ids)) == (30, 5, 8)
    bm.check_integrity()
    bm.free(0)
    bm.begin_step()
    assert bm.num_used_blocks == 0 and bm.tiers.host.allocator.num_used == 0


def test_parallel_samples_share_sliding_blocks():
    config = SchedulerConfig(num_blocks=400, block_size=BLOCK, max_model_len=6 * WINDOW, kv_layout=LAYOUT)
    seqs = _seqs(4, WINDOW + 3, 4 * WINDOW, n=3)
    scheduler = _run(config, seqs)
    assert scheduler.block_manager.num_used_blocks == 0


def test_decode_steps_claim_and_drop_blocks_only_at_block_boundaries_and_forks_copy_a_shared_last_block():
    bm = HybridBlockManager(LAYOUT, 64, BLOCK, enable_prefix_caching=False)
    prompt = list(range(3, 9))  # 6 tokens: blocks 0 and 1 (half full)
    bm.admit(1, prompt)
    assert bm.schedule(1, 0, len(prompt)) == []
    held = lambda: [bm.num_held_blocks(1, g) for g in range(LAYOUT.num_groups)]  # noqa: E731
    for position in range(len(prompt), 41):  # one decode step per position: 41 tokens, the last block part full
        before, before_free = held(), bm.allocator.num_free
        assert bm.schedule(1, position, 1) == []
        crossed = position % BLOCK == 0  # the token opens a new block in every group
        left = max(0, position - WINDOW + 1) // BLOCK != max(0, position - 1 - WINDOW + 1) // BLOCK
        assert held()[0] == before[0] + crossed  # the full group keeps every block
        for g in (1, 2):  # sliding groups: one block in at a boundary, one out when it leaves the window
            assert held()[g] == before[g] + crossed - (left and position > WINDOW), (position, g)
        assert before_free - bm.allocator.num_free == sum(held()) - sum(before)
        assert max(held()[1:]) <= DECODE_BOUND
        bm.check_integrity()
    assert 64 - bm.allocator.num_free == sum(held())
    # A fork shares the half-full last block in every group: the first token each writes copies it, once.
    bm.fork(1, 2)
    copies = bm.schedule(2, 41, 1)
    assert len(copies) == LAYOUT.num_groups and bm.schedule(2, 42, 1) == []
    bm.check_integrity()
    bm.free(1)
    bm.free(2)
    bm.check_integrity()
    assert bm.allocator.num_free == 64


@pytest.mark.parametrize("hybrid", [True, False])
def test_try_schedule_that_cannot_fit_changes_nothing_then_fits_once_blocks_free(hybrid):
    # A 40-token chunk takes 10 blocks per full table, and each sliding group holds every block of it until the
    # window moves on: 30 in the hybrid layout. The pools fit one such chunk, not two.
    bm = (HybridBlockManager(LAYOUT, 32, BLOCK, enable_prefix_caching=False, max_query_tokens=64) if hybrid
          else KVBlockManager(16, BLOCK, enable_prefix_caching=False))
    bm.admit(0, list(range(1, 41)))
    bm.admit(1, list(range(101, 141)))
    assert bm.try_schedule(0, 0, 40) is not None  # takes most of the pool
    free, held = bm.num_free_blocks, bm.block_ids(1) if not hybrid else bm.group_table(1, 0).block_ids[:]
    assert bm.try_schedule(1, 0, 40) is None
    assert bm.num_free_blocks == free
    assert (bm.block_ids(1) if not hybrid else bm.group_table(1, 0).block_ids) == held
    bm.check_integrity()
    bm.free(0)
    bm.begin_step()
    assert bm.try_schedule(1, 0, 40) == []  # no copy-on-write: a fresh table
    bm.check_integrity()
