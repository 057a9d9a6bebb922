"""The host tier's eviction around queued disk writes: blocks whose write is done go first, in LRU order (a prefix's
tail before its head); blocks still being written only when no other can be taken."""

from pagedkv.core.host_tier import HostTier
from pagedkv.core.kv_tiers import KVTiers
from pagedkv.core.prefix_cache import hash_blocks


def _keys(n, seed=0):
    return hash_blocks(list(range(seed, seed + 4 * n)), 4)


def _cached(host, keys):
    blocks = host.allocate(len(keys))
    for key, block in zip(keys, blocks):
        host.insert(key, block)
    return blocks


def test_eviction_passes_over_blocks_being_written_while_others_can_be_taken():
    host = HostTier(4)
    old, new = _keys(2), _keys(2, seed=100)
    old_blocks = _cached(host, old)
    host.touch(old_blocks)
    new_blocks = _cached(host, new)
    host.touch(new_blocks)  # LRU: old tail, old head, new tail, new head
    for block in old_blocks:
        host.start_write(block)
    host.check_integrity()
    taken = host.allocate(1)
    assert taken == [new_blocks[1]] and host.last_evicted_writing == 0  # the written prefix's tail
    assert host.match(old) == old_blocks  # the blocks being written stay cached
    assert host.allocate(1) == [new_blocks[0]] and host.match(new) == []
    host.check_integrity()
    # Every cached block is being written: the least recently used one goes (its spill waits for the write).
    assert host.allocate(1) == [old_blocks[1]] and host.last_evicted_writing == 1
    assert host.is_writing(old_blocks[1])  # the write still reads it: the copy into it must wait
    host.end_write(old_blocks[1])
    assert not host.is_writing(old_blocks[1])
    host.check_integrity()


def test_a_finished_write_puts_its_block_back_in_lru_order():
    host = HostTier(3)
    keys = _keys(3)
    blocks = _cached(host, keys)
    host.touch(blocks)  # LRU: tail h2, h1, head h0
    for block in blocks:
        host.start_write(block)
    host.end_write(blocks[0])  # the head's write finishes first
    host.end_write(blocks[2])
    assert host.allocate(1) == [blocks[2]]  # written blocks in LRU order: the tail, then the head
    assert host.allocate(1) == [blocks[0]] and host.match(keys) == []
    host.check_integrity()


def test_busy_blocks_are_not_taken_even_when_only_they_are_written():
    host = HostTier(2)
    keys = _keys(2)
    blocks = _cached(host, keys)
    host.start_write(blocks[1])
    host.mark_busy([blocks[0]])  # the only written block is read by this step's copies
    assert host.allocate(1) == [blocks[1]] and host.last_evicted_writing == 1
    assert host.allocate(1) is None
    host.check_integrity()


def test_tiers_track_queued_writes_until_the_runner_reports_them():
    tiers = KVTiers(3, disk_capacity_blocks=8)
    first, second = _keys(2), _keys(1, seed=100)
    for gpu_block, key in enumerate(first):
        tiers.on_gpu_evict(key, gpu_block)
    writes = tiers.take_copies().disk_writes
    assert len(writes) == 2 and all(tiers.host.is_writing(block) for _, block in writes)
    tiers.check_integrity(0)
    tiers.begin_step()
    tiers.finish_writes([(first[1], True)])  # the second key's write finished, the first's not yet
    tiers.on_gpu_evict(second[0], 2)
    tiers.take_copies()
    tiers.begin_step()
    tiers.on_gpu_evict(_keys(1, seed=200)[0], 3)  # the host is full: the written block goes, not the LRU one
    (spill,) = tiers.take_copies().offload
    assert spill.dst == writes[1][1] and tiers.match_host(first) == [writes[0][1]]
    tiers.check_integrity(0)
    tiers.finish_writes([(first[0], False), (second[0], True)])  # a failed write ends too
    assert not tiers.host.is_writing(writes[0][1])
    assert tiers.host.is_writing(spill.dst)  # the third key's write, queued with its spill, is still pending
    tiers.check_integrity(0)
