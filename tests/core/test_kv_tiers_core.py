"""KV tiers bookkeeping: host LRU (tail before head), busy blocks, the disk cap, loads, swap through the host pool."""

import random

import pytest

from pagedkv.core.block_manager import KVBlockManager
from pagedkv.core.group_tiers import group_key
from pagedkv.core.hybrid_block_manager import HybridBlockManager
from pagedkv.core.kv_groups import FULL_ATTENTION, SLIDING_ATTENTION, group_layers
from pagedkv.core.kv_tiers import DiskIndex, HostTier, KVTiers
from pagedkv.core.prefix_cache import hash_blocks


def _keys(n, seed=0):
    return hash_blocks(list(range(seed, seed + 4 * n)), 4)


def test_host_tier_evicts_a_prefix_tail_before_its_head():
    host = HostTier(4)
    keys = _keys(3)
    blocks = host.allocate(3)
    for key, block in zip(keys, blocks):
        host.insert(key, block)
    host.touch(blocks)  # the prefix used as a whole
    other = _keys(1, seed=100)[0]
    host.insert(other, host.allocate(1)[0])
    host.allocate(1)  # evicts the least recently used: the old prefix's tail (h2), not its head
    assert host.match(keys) == blocks[:2]
    host.allocate(1)  # then h1
    assert host.match(keys) == blocks[:1]
    host.check_integrity()


def test_busy_and_freed_host_blocks_wait_for_the_next_step():
    host = HostTier(2)
    key = _keys(1)[0]
    block = host.allocate(1)[0]
    host.insert(key, block)
    host.mark_busy([block])  # a restore reads it this step
    owned = host.allocate(1)
    assert host.allocate(1) is None  # the busy cached block is not evicted, and nothing else is free
    host.free(owned)
    assert host.allocate(1) is None  # freed this step: free from the next
    host.begin_step()
    assert len(host.allocate(2)) == 2 and host.match([key]) == []
    host.check_integrity()


def test_disk_index_keeps_its_cap_lru():
    disk = DiskIndex(3)
    keys = _keys(5)
    evicted = []
    for key in keys[:3]:
        evicted += disk.add(key)
    disk.touch(keys[:1])
    evicted += disk.add(keys[3])
    assert evicted == [keys[1]] and keys[0] in disk and disk.num_blocks == 3
    disk.check_integrity()


def test_tiers_spill_restore_and_load_from_disk():
    tiers = KVTiers(4, disk_capacity_blocks=8)
    keys = _keys(3)
    for gpu_block, key in enumerate(keys[:2]):
        tiers.on_gpu_evict(key, gpu_block)
    tiers.on_gpu_evict(keys[0], 5)  # already on the host: not copied again
    copies = tiers.take_copies()
    assert [c.src for c in copies.offload] == [0, 1] and len(copies.disk_writes) == 2
    tiers.finish_writes([(key, True) for key, _ in copies.disk_writes])
    # The third key is only on disk (a restart): the prefix waits for its load, then hits the host.
    tiers.disk.add(keys[2])
    assert tiers.prefetch(keys) is True
    (loaded_key, host_block), = tiers.take_copies().disk_loads
    assert loaded_key == keys[2] and tiers.prefetch(keys) is True  # still loading: no second load
    tiers.take_copies()
    tiers.finish_loads([(loaded_key, True)])
    assert tiers.prefetch(keys) is False
    host_blocks = tiers.match_host(keys)
    assert len(host_blocks) == 3 and host_blocks[2] == host_block
    tiers.restore(host_blocks, [10, 11, 12])
    assert tiers.stats.host_hit_blocks == 2 and tiers.stats.disk_hit_blocks == 1
    assert [(c.src, c.dst) for c in tiers.take_copies().restore] == list(zip(host_blocks, [10, 11, 12]))
    tiers.check_integrity(0)


def test_a_block_spilled_in_a_step_keeps_its_host_block_through_the_step():
    """Its copy fills the host block and its disk write reads it after the step's copies: an offload of the same
    step must not take that block over (the file would hold the other block's bytes under this key)."""
    tiers = KVTiers(2, disk_capacity_blocks=8)
    keys = _keys(3)
    for gpu_block, key in enumerate(keys):
        tiers.on_gpu_evict(key, gpu_block)
    copies = tiers.take_copies()
    assert [c.dst for c in copies.offload] == [0, 1]  # the third is dropped: both host blocks are this step's
    assert [block for _, block in copies.disk_writes] == [0, 1] and keys[2] not in tiers.host
    tiers.finish_writes([(key, True) for key, _ in copies.disk_writes])
    tiers.begin_step()
    tiers.on_gpu_evict(keys[2], 2)  # next step: the least recently used one makes room
    assert keys[2] in tiers.host and keys[0] not in tiers.host and keys[0] in tiers.disk
    tiers.check_integrity(0)


def test_a_failed_disk_load_is_a_miss_and_forgotten():
    tiers = KVTiers(2, disk_capacity_blocks=4)
    key = _keys(1)[0]
    tiers.disk.add(key)
    assert tiers.prefetch([key]) and len(tiers.take_copies().disk_loads) == 1
    tiers.begin_step()  # a load runs on across steps until its result comes back
    assert tiers.num_loading == 1 and tiers.prefetch([key]) and not tiers.take_copies().disk_loads
    tiers.finish_loads([(key, None)])  # its step failed: the load is dropped, the file stays indexed
    assert tiers.num_loading == 0 and key in tiers.disk and tiers.stats.disk_load_misses == 0
    assert tiers.prefetch([key]) and len(tiers.take_copies().disk_loads) == 1
    tiers.finish_loads([(key, False)])
    assert key not in tiers.disk and tiers.stats.disk_load_misses == 1
    assert tiers.prefetch([key]) is False and tiers.match_host([key]) == []
    tiers.begin_step()
    tiers.check_integrity(0)


def test_block_manager_restores_host_hits_and_swaps_through_the_same_pool():
    bm = KVBlockManager(4, 4, num_offload_blocks=4, num_swap_blocks=2)
    prompt = list(range(13))  # 3 full blocks could hit
    bm.begin_step()
    bm.admit(1, prompt)
    bm.append_slots(1, 13)
    bm.commit(1, prompt, 13)
    bm.free(1)
    bm.begin_step()
    bm.admit(2, list(range(100, 113)))  # takes the whole pool: the cached prefix spills to the host
    bm.append_slots(2, 13)
    copies = bm.take_tier_copies()
    assert len(copies.offload) == 3
    bm.free(2)
    bm.begin_step()
    assert bm.admit(3, prompt) == 12 and bm.is_restoring(3)
    assert len(bm.take_tier_copies().restore) == 3
    bm.begin_step()
    assert not bm.is_restoring(3)
    bm.append_slots(3, 1)
    swap = bm.swap_out(3)
    assert len(swap) == 4 and bm.is_swapped(3)  # 2 swap blocks + 2 evicted cached host blocks
    bm.check_integrity()
    bm.begin_step()
    bm.swap_in(3)
    bm.free(3)
    bm.begin_step()
    bm.check_integrity()


def _cache(bm, prompts):
    """Run each prompt (as sequences 1, 2, ...) to the end of its prefill and free it: its blocks stay cached."""
    for seq_id, prompt in enumerate(prompts, start=1):
        bm.begin_step()
        bm.admit(seq_id, prompt)
        bm.append_slots(seq_id, len(prompt))
        bm.commit(seq_id, prompt, len(prompt))
        bm.free(seq_id)


def _spill_two_prefixes(bm, first, second):
    """Cache `first` and `second`, then fill the pool with another prompt so both spill to the host tier."""
    _cache(bm, [first, second])
    bm.begin_step()
    filler = list(range(500, 500 + 4 * bm.num_blocks - 1))
    bm.admit(3, filler)
    bm.append_slots(3, len(filler))
    assert len(bm.take_tier_copies().offload) == 6
    bm.free(3)


def test_restores_within_the_in_step_budget_compute_in_their_step_and_the_rest_in_the_next():
    bm = KVBlockManager(8, 4, num_offload_blocks=8, max_in_step_restore_blocks=4)
    first, second = list(range(13)), list(range(100, 113))  # 3 full blocks could hit, each
    _spill_two_prefixes(bm, first, second)
    bm.begin_step()
    assert bm.admit(4, first) == 12 and not bm.is_restoring(4)  # 3 blocks: inside the budget of 4
    assert bm.admit(5, second) == 12 and bm.is_restoring(5)  # 3 more would pass it: beside the step
    copies = bm.take_tier_copies()
    assert [len(copies.restore_in_step), len(copies.restore)] == [3, 3]
    assert bm.admit(6, first + [7]) == 12 and not bm.is_restoring(6)  # shares blocks restored before the kernels
    assert bm.admit(7, second + [7]) == 12 and bm.is_restoring(7)  # shares blocks still on their way
    bm.begin_step()
    assert not bm.is_restoring(5) and not bm.is_restoring(7)
    for seq_id in (4, 5, 6, 7):
        bm.free(seq_id)
    bm.begin_step()
    bm.check_integrity()


def _one_table_manager():
    return KVBlockManager(16, 4, num_offload_blocks=12, num_swap_blocks=4, disk_capacity_blocks=20)


def _layer_group_manager():
    """Gemma-like: a full group and two sliding groups (window 6 tokens), each block one layer."""
    layout = group_layers((SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION), 6, bytes_per_token_per_layer=64)
    return HybridBlockManager(layout, 40, 4, num_offload_blocks=30, num_swap_blocks=10, disk_capacity_blocks=60,
                              max_query_tokens=64)


def _tier_key_of(bm, gpu_block):
    """The tiers' key of the block a GPU prefix cache holds as `gpu_block`."""
    if isinstance(bm, KVBlockManager):
        return bm.prefix_cache._key_of.get(gpu_block)
    group = next(g for g, cache in enumerate(bm.caches) if gpu_block in cache._key_of)
    return group_key(bm.caches[group]._key_of[gpu_block], group)


def _write_through(make):
    """`make`'s manager with write-through on (the same sizes)."""
    bm = make()
    bm._init_write_through(True)
    return bm


@pytest.mark.parametrize("make", [_one_table_manager, _layer_group_manager,
                                  lambda: _write_through(_one_table_manager),
                                  lambda: _write_through(_layer_group_manager)],
                         ids=["one table", "layer groups", "one table, write-through", "layer groups, write-through"])
def test_random_lifecycles_leave_every_tier_clean(make):
    """1,000 requests over shared prefixes with aborts and swaps: every tier's integrity holds throughout."""
    rng = random.Random(5)
    bm = make()
    heads = [[rng.randint(0, 50) for _ in range(12)] for _ in range(5)]
    live: dict[int, list[int]] = {}
    for seq_id in range(1000):
        bm.begin_step()
        prompt = rng.choice(heads) + [rng.randint(0, 50) for _ in range(rng.randint(1, 9))]
        if bm.prefetch(prompt):
            # the runner reads the files during the step; the results come back before the next one
            copies = bm.take_tier_copies()
            bm.tiers.finish_loads([(key, rng.random() < 0.9) for key, _ in copies.disk_loads])
            bm.tiers.finish_writes([(key, rng.random() < 0.95) for key, _ in copies.disk_writes])
            continue
        if bm.can_admit(bm.blocks_to_admit(prompt), 0.0):
            num_cached = bm.admit(seq_id, prompt)
            bm.append_slots(seq_id, len(prompt) - bm.num_tokens(seq_id))
            bm.schedule(seq_id, num_cached, len(prompt) - num_cached)
            bm.commit(seq_id, prompt, len(prompt))
            bm.release_out_of_window(seq_id, len(prompt))
            live[seq_id] = prompt
        bm.pre_spill()
        copies = bm.take_tier_copies()
        for copy in copies.pre_offload:  # a copy ahead of eviction names the block the host then holds
            assert bm.tiers.host._key_of.get(copy.dst) == _tier_key_of(bm, copy.src), copy
        for copy in copies.restore + copies.restore_in_step:  # a spill never took the host block a restore reads
            assert bm.tiers.host._key_of.get(copy.src) == _tier_key_of(bm, copy.dst), copy
        bm.tiers.finish_writes([(key, rng.random() < 0.95) for key, _ in copies.disk_writes])
        for done in [s for s in live if rng.random() < 0.4]:
            if bm.is_swapped(done) and rng.random() < 0.5 and bm.can_admit(bm.blocks_to_swap_in(done), 0.0):
                bm.swap_in(done)
            elif bm.has_table(done) and rng.random() < 0.3 and bm.can_swap_out(done):
                bm.swap_out(done)
            else:
                bm.free(done)  # finished or aborted
                del live[done]
        bm.check_integrity()
    for seq_id in list(live):
        bm.free(seq_id)
    bm.begin_step()
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and bm.tiers.host.allocator.num_used == bm.tiers.host.num_cached
    stats = bm.tiers.stats
    assert stats.host_hit_blocks > 0 and stats.offloaded_blocks > 0 and stats.disk_hit_blocks > 0


@pytest.mark.parametrize("held, num_cached_tokens", [
    ({0: range(5), 1: (3, 4), 2: (3, 4)}, 20),  # every full block, and the window at position 20 (blocks 3, 4)
    ({0: (0, 1, 3, 4), 1: range(5), 2: range(5)}, 8),  # the full group lacks block 2: the hit stops before it
    ({0: range(5), 1: (2, 3, 4), 2: (2, 3)}, 16),  # a window lacks block 4: the longest hit whose windows are held
])
def test_a_layer_group_hit_over_the_tiers_needs_the_full_prefix_and_only_the_windows(held, num_cached_tokens):
    """Blocks only in the host tier, keyed per group: a hit takes the full group's whole prefix and the sliding
    groups' windows, and restores exactly those."""
    bm = _layer_group_manager()
    prompt = list(range(21))  # 5 blocks could hit
    keys = hash_blocks(prompt, 4)[:5]
    for g, blocks in held.items():
        for i in blocks:
            bm.tiers.host.insert(group_key(keys[i], g), bm.tiers.host.allocate(1)[0])
    bm.begin_step()
    assert bm.admit(1, prompt) == num_cached_tokens and bm.is_restoring(1)
    num_hit = num_cached_tokens // 4
    restored = sum(num_hit - group.first_live_block(num_cached_tokens, 4) for group in bm.groups)
    assert len(bm.take_tier_copies().restore) == restored == bm.tiers.stats.host_hit_blocks
    for g, group in enumerate(bm.groups):
        assert getattr(bm.group_table(1, g), "num_dropped", 0) == group.first_live_block(num_cached_tokens, 4)
    bm.free(1)
    bm.begin_step()
    bm.check_integrity()


def test_a_restore_keeps_its_host_blocks_from_the_spills_its_allocation_causes():
    """A full host tier, a GPU pool of evictable blocks: restoring a prefix evicts GPU blocks, whose spills must
    not take the host blocks being restored (the runner copies device -> host first: they would be overwritten)."""
    bm = KVBlockManager(4, 4, num_offload_blocks=3)
    first, second = list(range(13)), list(range(100, 113))
    _cache(bm, [first, second])  # the second evicts the first: it spills, the host is full
    bm.take_tier_copies()
    bm.begin_step()
    keys = hash_blocks(first, 4)[:3]
    host_blocks = bm.tiers.host.match(keys)
    assert bm.admit(3, first) == 12
    copies = bm.take_tier_copies()
    assert [c.src for c in copies.restore + copies.restore_in_step] == host_blocks
    assert not copies.offload and bm.tiers.host.match(keys) == host_blocks  # the evicted GPU blocks are dropped
    bm.free(3)
    bm.begin_step()
    bm.check_integrity()


def test_pre_spill_skips_a_settled_cache_and_takes_each_new_evictable_block():
    """Evictable GPU blocks go to the host ahead of eviction; a step that changed nothing copies nothing again, and a
    block that becomes evictable later is still copied (the skip follows the cache's and the host's changes)."""
    bm = KVBlockManager(16, 4, num_offload_blocks=16)
    _cache(bm, [list(range(9))])  # 2 full blocks cached, evictable
    bm.begin_step()
    bm.pre_spill()
    assert len(bm.take_tier_copies().pre_offload) == 2
    bm.begin_step()
    bm.pre_spill()
    assert not bm.take_tier_copies().pre_offload  # both on the host already
    _cache(bm, [list(range(100, 113))])  # 3 more blocks become evictable
    bm.begin_step()
    bm.pre_spill()
    assert len(bm.take_tier_copies().pre_offload) == 3
    bm.begin_step()
    bm.pre_spill(max_blocks=1)
    assert not bm.take_tier_copies().pre_offload
    bm.check_integrity()


@pytest.mark.parametrize("host_tier", [True, False])
def test_recent_keys_name_the_gpu_cache_first_then_the_host_tier(host_tier):
    """What a replica tells the routers: a prefix spilled to the host tier still hits there (a copy, not a
    prefill), so its keys stay published after the GPU cache evicted them; without a host tier they go."""
    bm = KVBlockManager(4, 4, num_offload_blocks=4 if host_tier else 0)
    prompt = list(range(13))
    _cache(bm, [prompt])
    spilled = hash_blocks(prompt[:12], 4)
    assert bm.recent_keys(10) == list(reversed(spilled))  # on the GPU, the most recently cached first
    filler = list(range(100, 113))
    _cache(bm, [filler])  # takes the whole pool: the prompt's blocks leave the GPU cache
    on_gpu = list(reversed(hash_blocks(filler[:12], 4)))
    keys = bm.recent_keys(10)
    assert keys[:3] == on_gpu
    # The host tier's most recent first: the GPU cache evicts a prefix tail first, so its head came last.
    assert keys[3:] == (spilled if host_tier else [])
    assert bm.recent_keys(4) == on_gpu + spilled[:1 if host_tier else 0]  # the limit holds
    bm.check_integrity()


def test_a_layer_group_manager_publishes_no_host_tier_keys():
    """Its host tier holds blocks under per-group keys (`group_key`), which no router could match to a prompt."""
    rng = random.Random(7)
    bm = _layer_group_manager()
    for seq_id in range(60):
        bm.begin_step()
        prompt = [rng.randint(0, 50) for _ in range(rng.randint(8, 24))]
        if bm.can_admit(bm.blocks_to_admit(prompt), 0.0):
            num_cached = bm.admit(seq_id, prompt)
            bm.append_slots(seq_id, len(prompt) - bm.num_tokens(seq_id))
            bm.schedule(seq_id, num_cached, len(prompt) - num_cached)
            bm.commit(seq_id, prompt, len(prompt))
            bm.free(seq_id)
        bm.take_tier_copies()
    assert bm.tiers.host.num_cached > 0  # prefixes did spill
    published = bm.recent_keys(10_000)
    assert published and set(published) <= set(bm.prefix_cache._block_of)
    assert not set(published) & set(bm.tiers.host._block_of)


def test_a_restore_stops_at_a_block_the_gpu_still_holds():
    """The GPU cache lost a prefix's head but holds a later block of its chain: the host tier restores the head
    only, and the prompt computes from that block on (it is never restored over the GPU's copy)."""
    bm = KVBlockManager(4, 4, num_offload_blocks=8)
    prompt = list(range(13))  # 3 full blocks that could hit
    _cache(bm, [prompt])
    bm.begin_step()
    bm.pre_spill()  # all three on the host too, still cached on the GPU
    assert len(bm.take_tier_copies().pre_offload) == 3
    keys = hash_blocks(prompt, 4)[:3]
    bm.prefix_cache.on_released(bm.prefix_cache.match(keys)[2:])  # the chain's last block used most recently
    bm.begin_step()
    bm.admit(2, list(range(100, 109)))  # 3 blocks: the free one and the two least recently used, the head
    bm.append_slots(2, 9)
    assert bm.prefix_cache.match(keys) == [] and keys[2] in bm.prefix_cache
    bm.free(2)
    bm.begin_step()
    assert bm.admit(3, prompt) == 8  # the head's two blocks restored; the third computes
    copies = bm.take_tier_copies()
    assert len(copies.restore + copies.restore_in_step) == 2
    bm.free(3)
    bm.begin_step()
    bm.check_integrity()


def test_a_step_can_restore_a_block_it_spills_and_the_runner_sees_it():
    """One step evicts a prompt's cached tail (spilled into a fresh host block) and then admits that prompt, whose
    host hit is the block just spilled: the runner must read it from the spill (its copy to the host may not have
    run yet; tests/engine/test_kv_offload_order.py checks the runner's side)."""
    bm = KVBlockManager(6, 4, num_offload_blocks=8)
    first, second = list(range(13)), list(range(100, 113))
    _cache(bm, [first, second])  # 6 full blocks cached, none on the host yet
    bm.take_tier_copies()
    bm.begin_step()
    bm.admit(3, list(range(200, 209)))  # 3 blocks: evicts the first prompt's blocks (LRU), spilled
    bm.append_slots(3, 9)
    assert bm.admit(4, first) == 12  # its 3 blocks are back on the host already: restored in the same step
    copies = bm.take_tier_copies()
    restored = copies.restore + copies.restore_in_step
    assert restored and {c.src for c in restored} & {c.dst for c in copies.offload}
    bm.free(3)
    bm.free(4)
    bm.begin_step()
    bm.check_integrity()


def test_a_prefix_hit_on_the_host_keeps_its_disk_files_ahead_of_colder_writes():
    """The disk's LRU follows use, not write time: a prefix written to disk first and hit on the host since keeps
    its files when colder blocks' writes fill the disk; a prefix nobody used since loses them."""
    bm = KVBlockManager(8, 4, num_offload_blocks=16, disk_capacity_blocks=6)
    first, second = list(range(13)), list(range(100, 113))  # 3 full blocks could hit, each
    _spill_two_prefixes(bm, first, second)  # first's blocks spill (and are written) before second's
    first_keys, second_keys = hash_blocks(first, 4)[:3], hash_blocks(second, 4)[:3]
    assert all(key in bm.tiers.disk for key in first_keys + second_keys)
    bm.begin_step()
    assert bm.admit(4, first) == 12  # a host hit
    bm.free(4)
    _cache(bm, [list(range(200, 213))])  # a third prefix, then a prompt that takes the whole pool: it spills
    bm.begin_step()
    filler = list(range(500, 500 + 4 * bm.num_blocks - 1))
    bm.admit(3, filler)
    bm.append_slots(3, len(filler))
    assert len(bm.take_tier_copies().disk_writes) == 3  # the third prefix's (the first's are on disk already)
    assert all(key in bm.tiers.disk for key in first_keys)
    assert not any(key in bm.tiers.disk for key in second_keys)
    bm.free(3)
    bm.begin_step()
    bm.check_integrity()


def test_a_layer_group_prefix_hit_keeps_its_disk_files_ahead_of_colder_writes():
    """The same with layer groups: the hit's blocks of each group (the full group's prefix, the sliding groups'
    windows) become the disk's newest files, newer than those written after them."""
    bm = _layer_group_manager()
    prompt, other = list(range(21)), list(range(100, 121))  # 5 blocks could hit, each
    keys = hash_blocks(prompt, 4)[:5]
    for g in range(len(bm.groups)):  # every block of every group on the host, and on disk
        for key in keys:
            bm.tiers.host.insert(group_key(key, g), bm.tiers.host.allocate(1)[0])
            bm.tiers.disk.add(group_key(key, g))
    later = [group_key(key, g) for key in hash_blocks(other, 4)[:5] for g in range(len(bm.groups))]
    for key in later:  # written after them
        bm.tiers.disk.add(key)
    bm.begin_step()
    assert bm.admit(1, prompt) == 20
    hit = {group_key(keys[i], g) for g, group in enumerate(bm.groups) for i in range(group.first_live_block(20, 4), 5)}
    order = list(bm.tiers.disk._lru)
    assert min(order.index(key) for key in hit) > max(order.index(key) for key in later)
    bm.free(1)
    bm.begin_step()
    bm.check_integrity()


def test_a_shutdown_keeps_the_most_recently_used_blocks_of_every_tier_on_disk():
    """Host blocks in their LRU order, then the GPU's, newer than what only the disk has; at most the cap, so no
    write is evicted by the next one; keys on disk already are kept, not written again."""
    tiers = KVTiers(8, disk_capacity_blocks=4)
    p, q, r = _keys(3, seed=0), _keys(3, seed=100), _keys(2, seed=200)
    for gpu_block, key in enumerate(p[::-1] + q[::-1]):  # spilled tail first, as the GPU cache evicts
        tiers.on_gpu_evict(key, gpu_block)
    writes = tiers.take_copies().disk_writes
    tiers.finish_writes([(key, True) for key, _ in writes])
    assert set(tiers.disk._lru) == {p[0], *q}  # the cap kept the last four written
    tiers.host.touch(tiers.match_host(p))  # p used on the host since: newer than q
    tiers.begin_step()
    from_gpu, from_host = tiers.persist([(r[1], 0), (r[0], 1)])  # the GPU's, least recently used first
    assert [key for key, _ in from_gpu] == [r[1], r[0]] and [key for key, _ in from_host] == [p[1]]
    assert set(tiers.disk._lru) == {p[0], p[1], r[0], r[1]}  # a whole prefix head and the working set
    assert set(tiers.take_copies().disk_deletes) == set(q)


def test_layer_group_blocks_to_persist_interleave_the_groups_from_their_newest_blocks():
    """A shutdown cuts the list to the disk's cap from its newest end: every group's newest blocks must be there
    (a hit needs all groups), not only the last group's whole cache."""
    from types import SimpleNamespace

    from pagedkv.core.group_tiers import GroupTiers

    a, b = _keys(2, seed=0), _keys(6, seed=100)  # each cache's blocks, least recently used first
    caches = [SimpleNamespace(cached_blocks=lambda keys=keys: [(key, i) for i, key in enumerate(keys)])
              for keys in (a, b)]
    listed = GroupTiers([None, None], caches, None, 4).cached_blocks()
    assert len(listed) == 8 and listed[-4:] == [(group_key(b[4], 1), 4), (group_key(a[0], 0), 0),
                                                (group_key(b[5], 1), 5), (group_key(a[1], 0), 1)]


def test_an_admission_touches_its_prefix_on_disk_before_its_own_evictions_write():
    """The restore's GPU blocks evict a cached block, whose spill's write evicts the disk's least recently used
    file: that must not be one of the prefix being admitted (written first, but used now)."""
    bm = KVBlockManager(8, 4, num_offload_blocks=16, disk_capacity_blocks=6)
    first, second = list(range(13)), list(range(100, 113))
    _spill_two_prefixes(bm, first, second)  # 6 files: first's the oldest
    bm.take_tier_copies()
    _cache(bm, [list(range(200, 213)), list(range(300, 313))])  # 6 of the 8 GPU blocks cached, 2 free
    bm.take_tier_copies()
    bm.begin_step()
    assert bm.admit(4, first) == 12  # 3 restored blocks: one cached GPU block is evicted, spilled and written
    assert len(bm.take_tier_copies().disk_writes) == 1
    assert all(key in bm.tiers.disk for key in hash_blocks(first, 4)[:3])
    bm.free(4)
    bm.begin_step()
    bm.check_integrity()


def test_an_early_restore_skips_host_blocks_a_spill_of_the_same_step_fills():
    """`stage_restore` (the runner's early copies) gets a restore's host blocks at once, but not when a spill of
    the same step fills one of them: that copy to the host runs only with the step's moves, and the restore must
    read the spill's gathered blocks there."""
    bm = KVBlockManager(4, 4, num_offload_blocks=8)
    staged = []
    bm.tiers.stage_restore = staged.append
    prompt, other = list(range(13)), list(range(100, 113))
    _cache(bm, [prompt])  # cached on the GPU only
    bm.take_tier_copies()
    bm.begin_step()
    bm.admit(2, other)  # takes the pool: the cached prefix spills to the host in this step
    bm.append_slots(2, 13)
    bm.free(2)
    assert bm.admit(3, prompt) == 12  # its prefix back from the host blocks this step's spills fill
    copies = bm.take_tier_copies()
    restored = [c.src for c in copies.restore + copies.restore_in_step]
    assert restored and set(restored) <= {c.dst for c in copies.offload}
    assert staged == []
    bm.free(3)
    bm.begin_step()
    bm.admit(4, other)  # the prefix's blocks leave the GPU again (their keys are on the host: no copy)
    bm.append_slots(4, 13)
    bm.free(4)
    bm.take_tier_copies()
    bm.begin_step()
    assert bm.admit(5, prompt) == 12
    copies = bm.take_tier_copies()
    assert staged == [[c.src for c in copies.restore + copies.restore_in_step]]
    bm.free(5)
    bm.begin_step()
    bm.check_integrity()


@pytest.mark.parametrize("make", [lambda **kw: KVBlockManager(16, 4, num_offload_blocks=16, **kw),
                                  lambda **kw: HybridBlockManager(
                                      group_layers((SLIDING_ATTENTION, FULL_ATTENTION), 6,
                                                   bytes_per_token_per_layer=64),
                                      32, 4, num_offload_blocks=32, max_query_tokens=64, **kw)],
                         ids=["one table", "layer groups"])
def test_write_through_copies_a_running_prompts_blocks_once_computed_so_their_eviction_copies_nothing(make):
    """With write-through a running sequence's blocks go to the host tier from the step after they are committed
    (never before: until then their KV may not be computed), once; evicting them later spills nothing. Without
    it, nothing is copied while the sequence runs, and the eviction spills every block."""
    prompt = list(range(13))  # 3 full blocks
    for write_through in (True, False):
        bm = make(write_through=write_through)
        bm.begin_step()
        bm.admit(1, prompt)
        bm.append_slots(1, len(prompt))
        bm.schedule(1, 0, len(prompt))
        bm.pre_spill()  # the prompt's KV is not computed yet
        assert not bm.take_tier_copies().pre_offload
        bm.commit(1, prompt, len(prompt))  # its step launched: 3 blocks computed (per group)
        bm.begin_step()
        bm.pre_spill()
        ahead = bm.take_tier_copies().pre_offload
        for copy in ahead:
            assert bm.tiers.host._key_of.get(copy.dst) == _tier_key_of(bm, copy.src)
        bm.begin_step()
        bm.pre_spill()
        assert not bm.take_tier_copies().pre_offload  # each block once
        bm.free(1)
        bm.begin_step()
        size = 4 * bm.num_blocks  # the longest filler the pool admits: it evicts the prompt's blocks
        while not bm.can_admit(bm.blocks_to_admit(list(range(500, 500 + size))), 0.0):
            size -= 1
        filler = list(range(500, 500 + size))
        bm.admit(2, filler)
        bm.append_slots(2, len(filler))
        bm.schedule(2, 0, len(filler))
        spilled = bm.take_tier_copies().offload
        if write_through:
            assert len(ahead) >= 3 and not spilled
        else:
            assert not ahead and len(spilled) >= 3
        bm.free(2)
        bm.begin_step()
        assert bm.admit(3, prompt) == 12  # a host hit either way
        bm.free(3)
        bm.begin_step()
        bm.check_integrity()


def test_write_through_stops_when_the_host_tier_has_no_free_block():
    """Write-through takes free host blocks only; once none is left its queue is dropped (the host tier's LRU,
    not a guess about evictions, decides what the host keeps), and the blocks spill on eviction as without it."""
    bm = KVBlockManager(32, 4, num_offload_blocks=2, write_through=True)
    prompt = list(range(21))  # 5 full blocks, 2 host blocks
    bm.begin_step()
    bm.admit(1, prompt)
    bm.append_slots(1, len(prompt))
    bm.commit(1, prompt, len(prompt))
    bm.begin_step()
    bm.pre_spill()
    assert len(bm.take_tier_copies().pre_offload) == 2 and not bm._write_through
    bm.free(1)
    bm.begin_step()
    bm.check_integrity()


@pytest.mark.parametrize("make", [lambda: KVBlockManager(32, 4, num_offload_blocks=16, write_through=True),
                                  lambda: HybridBlockManager(
                                      group_layers((SLIDING_ATTENTION, FULL_ATTENTION), 6,
                                                   bytes_per_token_per_layer=64),
                                      32, 4, num_offload_blocks=32, max_query_tokens=64, write_through=True)],
                         ids=["one table", "layer groups"])
def test_write_through_copies_a_prefix_two_requests_computed_in_one_step_once(make):
    """Two requests admitted in one step with the same new prompt both compute it (neither can hit the other) and
    both commit its keys: one copy per key, and no host block taken without its key (a leak `check_integrity`
    names)."""
    bm = make()
    prompt = list(range(13))
    bm.begin_step()
    for seq_id in (1, 2):
        bm.admit(seq_id, prompt)
        bm.append_slots(seq_id, len(prompt))
        bm.schedule(seq_id, 0, len(prompt))
    for seq_id in (1, 2):
        bm.commit(seq_id, prompt, len(prompt))
    bm.begin_step()
    bm.pre_spill()
    copies = bm.take_tier_copies().pre_offload
    assert len({bm.tiers.host._key_of.get(c.dst) for c in copies}) == len(copies) > 0
    bm.free(1)
    bm.free(2)
    bm.begin_step()
    bm.check_integrity()
