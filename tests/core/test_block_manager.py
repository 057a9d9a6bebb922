"""KVBlockManager.try_schedule counts a step's new blocks once and hands the count down to the append.

The reference below is the same contract spelled with public calls (count with `blocks_needed`, then
`schedule`, which counts again). Both managers run one scenario that grows across blocks, evicts cached
blocks, copies a shared partial block on write, runs short of blocks and grows past the length limit;
every answer, table and free count must agree, and both pass `check_integrity()` after every step.
"""

from pagedkv.core.block_manager import KVBlockManager
from pagedkv.core.block_table import BlockTable
from pagedkv.errors import PagedKVError


def reference_try_schedule(bm, seq_id, num_computed_tokens, num_new_tokens):
    missing = num_computed_tokens + num_new_tokens - bm.num_tokens(seq_id)
    if missing > 0 and bm.blocks_needed(seq_id, missing) > bm.num_free_blocks:
        return None
    return bm.schedule(seq_id, num_computed_tokens, num_new_tokens)


def run_scenario(try_schedule):
    bm = KVBlockManager(num_blocks=8, block_size=4, max_num_tokens=24)
    trace = []

    def step(seq_id, num_computed_tokens, num_new_tokens):
        try:
            copies = try_schedule(bm, seq_id, num_computed_tokens, num_new_tokens)
            outcome = None if copies is None else [(c.src, c.dst) for c in copies]
        except PagedKVError as error:
            outcome = type(error).__name__
        bm.check_integrity()
        tables = {seq: list(table.block_ids) for seq, table in sorted(bm._tables.items())}
        trace.append((outcome, tables, bm.allocator.num_free, bm.prefix_cache.num_evictable))

    prompt = list(range(10))
    bm.admit(0, prompt)
    step(0, 0, 10)
    bm.commit(0, prompt, 10)
    bm.free(0)  # two full blocks stay cached, evictable
    bm.admit(1, list(range(100, 120)))
    step(1, 0, 20)
    bm.admit(2, list(range(200, 206)))
    step(2, 0, 6)  # the free list is short: a cached block is evicted
    bm.fork(2, 3)
    step(3, 0, 7)  # the shared partial last block is copied on write
    bm.free(3)
    step(1, 20, 4)  # to the length limit, with the pool's last block
    step(1, 24, 1)  # past it with the pool short: None
    bm.free(2)
    step(1, 24, 1)  # past it with blocks free: SequenceTooLongError
    bm.admit(4, list(range(300, 312)))
    step(4, 0, 12)  # more blocks than are free: None
    return trace


def test_try_schedule_behaves_as_count_then_schedule():
    trace = run_scenario(lambda bm, *args: bm.try_schedule(*args))
    assert trace == run_scenario(reference_try_schedule)
    outcomes = [outcome for outcome, *_ in trace]
    # The scenario reaches every branch it names.
    assert None in outcomes and "SequenceTooLongError" in outcomes
    assert any(isinstance(outcome, list) and outcome for outcome in outcomes)  # a copy-on-write copy
    assert any(after[3] < before[3] for before, after in zip(trace, trace[1:]))  # an eviction


def test_try_schedule_counts_the_new_blocks_once(monkeypatch):
    calls = []
    count = BlockTable.num_blocks_needed
    monkeypatch.setattr(BlockTable, "num_blocks_needed", lambda self, n: calls.append(n) or count(self, n))
    bm = KVBlockManager(num_blocks=8, block_size=4)
    bm.admit(0, list(range(6)))
    bm.try_schedule(0, 0, 6)
    num_calls = len(calls)
    twin = BlockTable(bm.allocator, 4)
    calls.clear()
    twin.append_tokens(6)  # the table's own all-or-nothing check counts once more
    num_table_calls = len(calls)
    twin.free()
    bm.check_integrity()
    assert num_calls == 1 + num_table_calls
