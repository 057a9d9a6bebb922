"""The scheduler and block manager with a fake model: admission, preemption, swap, prefix reuse, aborts."""

import random

import pytest

from pagedkv.core.block_manager import KVBlockManager
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.engine.sequence import FinishReason, Sequence, SequenceStatus
from pagedkv.errors import ConfigError, RequestRejectedError

EOS = 0


class FakeModel:
    """Emits tokens from a per-sequence seeded stream, so outputs depend only on the sequence."""

    def sample(self, seq):
        rng = random.Random(hash((tuple(seq.prompt_token_ids), seq.sample_index, seq.num_tokens)))
        return rng.randint(1, 999)


def make_seq(seq_id, prompt_len, max_tokens, arrival=None, priority=0, prompt=None, ignore_eos=True):
    prompt = prompt if prompt is not None else [(seq_id * 7 + i) % 997 + 1 for i in range(prompt_len)]
    return Sequence(seq_id, f"r{seq_id}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                    arrival_index=seq_id if arrival is None else arrival, priority=priority)


def run_to_completion(scheduler, model=FakeModel(), max_steps=100_000, check_every_step=True, on_step=None):
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert not out.is_empty or out.rejected, "scheduler stalled with work left"
        sampled = {item.seq.seq_id: model.sample(item.seq) for item in out.scheduled if item.samples}
        scheduler.update(out, sampled)
        if on_step:
            on_step(steps, out)
        if check_every_step:
            scheduler.check_integrity()
        steps += 1
        assert steps < max_steps
    return steps


def outputs(seqs):
    return {s.seq_id: s.output_token_ids for s in seqs}


def test_continuous_batching_finishes_everything():
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=32))
    seqs = [make_seq(i, 5 + i * 3, 4 + i) for i in range(10)]
    for seq in seqs:
        scheduler.add(seq)
    run_to_completion(scheduler)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert [s.num_output_tokens for s in seqs] == [4 + i for i in range(10)]
    assert scheduler.block_manager.num_used_blocks == 0


def test_chunked_prefill_respects_the_token_budget():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=8)
    scheduler = Scheduler(cfg)
    scheduler.add(make_seq(0, 20, 2))
    scheduler.add(make_seq(1, 3, 2))
    budgets = []
    run_to_completion(scheduler, on_step=lambda i, out: budgets.append(out.num_batched_tokens))
    assert max(budgets) <= 8
    assert budgets[0] == 8  # the first step is a full chunk of seq 0's prompt


def test_decodes_come_first_in_the_step():
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64))
    scheduler.add(make_seq(0, 6, 5))
    out = scheduler.schedule()
    scheduler.update(out, {0: 5})
    scheduler.add(make_seq(1, 9, 5))
    out = scheduler.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 9)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["newest", "priority", "cheapest", "requester"])
def test_preemption_gives_the_same_outputs_as_a_large_pool(mode, policy):
    def run(num_blocks):
        cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=64, max_num_batched_tokens=16,
                              watermark=0.0, preemption_mode=mode, victim_policy=policy,
                              num_swap_blocks=8 if mode == "swap" else 0)
        scheduler = Scheduler(cfg)
        seqs = [make_seq(i, 6 + i % 5, 20, priority=i % 3) for i in range(12)]
        for seq in seqs:
            scheduler.add(seq)
        run_to_completion(scheduler)
        return seqs, scheduler

    small_seqs, small = run(14)
    big_seqs, big = run(1000)
    assert small.stats.num_preemptions > 0, "the tiny pool should force preemption"
    if mode == "swap":
        assert small.stats.num_swap_outs > 0 and small.stats.num_swap_ins == small.stats.num_swap_outs
    assert big.stats.num_preemptions == 0
    assert outputs(small_seqs) == outputs(big_seqs)


def test_never_fit_is_rejected_and_the_queue_moves():
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=100))
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len 100"):
        scheduler.add(make_seq(0, 90, 20))
    with pytest.raises(RequestRejectedError, match="8 blocks"):
        scheduler.add(make_seq(1, 30, 10))  # 40 tokens > 32-token pool
    with pytest.raises(RequestRejectedError, match="empty"):
        scheduler.add(make_seq(2, 0, 3, prompt=[]))
    ok = make_seq(3, 5, 3)
    scheduler.add(ok)
    run_to_completion(scheduler)
    assert ok.finish_reason is FinishReason.LENGTH and scheduler.num_unfinished == 0


def test_abort_returns_blocks_at_any_point():
    scheduler = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    a, b, c = make_seq(0, 20, 10), make_seq(1, 4, 10), make_seq(2, 4, 10)
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()  # a is mid-prefill
    scheduler.update(out, {})
    assert a.status is SequenceStatus.RUNNING and 0 < a.num_computed_tokens < a.num_prompt_tokens
    scheduler.abort([a.seq_id, c.seq_id])
    assert a.finish_reason is FinishReason.ABORT and c.finish_reason is FinishReason.ABORT
    scheduler.check_integrity()
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0


def test_prefix_cache_shares_blocks_and_gives_identical_outputs():
    shared = list(range(1, 41))  # 10 full blocks of 4
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128)
    scheduler = Scheduler(cfg)
    first = make_seq(0, 0, 5, prompt=shared + [50, 51])
    scheduler.add(first)
    run_to_completion(scheduler)
    second = make_seq(1, 0, 5, prompt=shared + [50, 51])
    scheduler.add(second)
    out = scheduler.schedule()
    assert second.num_cached_tokens == 40
    assert out.scheduled[0].start == 40 and out.scheduled[0].num_new_tokens == 2
    scheduler.update(out, {1: FakeModel().sample(second)})
    run_to_completion(scheduler)
    assert second.output_token_ids == first.output_token_ids
    assert scheduler.block_manager.prefix_cache.num_hits == 10


def test_prefix_cache_never_serves_the_last_prompt_token():
    cfg = SchedulerConfig(num_blocks=64, block_size=4)
    scheduler = Scheduler(cfg)
    prompt = list(range(1, 9))  # exactly 2 blocks
    scheduler.add(make_seq(0, 0, 2, prompt=prompt))
    run_to_completion(scheduler)
    again = make_seq(1, 0, 2, prompt=prompt)
    scheduler.add(again)
    out = scheduler.schedule()
    assert again.num_cached_tokens == 4 and out.scheduled[0].num_new_tokens == 4


def test_lru_eviction_under_pressure():
    bm = KVBlockManager(num_blocks=6, block_size=2)
    bm.admit(0, [1, 2, 3, 4, 5])
    bm.append_slots(0, 5)
    bm.commit(0, [1, 2, 3, 4, 5], 5)
    bm.free(0)
    assert bm.prefix_cache.num_evictable == 2 and bm.num_free_blocks == 6
    bm.admit(1, [9] * 11)
    bm.append_slots(1, 11)  # needs all 6: evicts both cached blocks
    assert bm.prefix_cache.num_cached == 0
    bm.free(1)
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_naive_reservation_limits_concurrency():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=32, reservation="naive")
    scheduler = Scheduler(cfg)
    for i in range(20):
        scheduler.add(make_seq(i, 4, 4))
    out = scheduler.schedule()
    assert len(out.scheduled) == 64 // 8  # 32 tokens = 8 blocks each
    run_to_completion(scheduler)


def test_watermark_holds_back_admission():
    cfg = SchedulerConfig(num_blocks=10, block_size=4, max_model_len=40, watermark=0.3)
    scheduler = Scheduler(cfg)
    scheduler.add(make_seq(0, 12, 4))  # 3 blocks
    scheduler.add(make_seq(1, 16, 4))  # 4 blocks: 10 - 3 - 4 = 3 >= 3 reserve: admitted
    scheduler.add(make_seq(2, 4, 4))  # 1 block: would leave 2 < 3: held back
    out = scheduler.schedule()
    assert sorted(i.seq.seq_id for i in out.scheduled) == [0, 1]
    run_to_completion(scheduler)


def test_bad_configs():
    with pytest.raises(ConfigError, match="victim_policy"):
        SchedulerConfig(num_blocks=4, victim_policy="oldest")
    with pytest.raises(ConfigError, match="swap"):
        SchedulerConfig(num_blocks=4, preemption_mode="swap")
    with pytest.raises(ConfigError, match="watermark"):
        SchedulerConfig(num_blocks=4, watermark=1.5)


def test_fork_shares_blocks_with_copy_on_write():
    import itertools

    scheduler = Scheduler(SchedulerConfig(num_blocks=32, block_size=4), seq_ids=itertools.count(1))
    parent = make_seq(0, 6, 4)
    scheduler.add(parent)
    out = scheduler.schedule()
    scheduler.update(out, {0: [7, 8]})  # the first sample of an n = 2 request: the parent forks one child
    assert [c.seq_id for c in out.forked] == [1]
    child = out.forked[0]
    assert child.sample_index == 1 and child.token_ids == parent.prompt_token_ids + [8]
    assert parent.token_ids == parent.prompt_token_ids + [7]
    bm = scheduler.block_manager
    assert bm.block_ids(1) == bm.block_ids(0)
    out = scheduler.schedule()
    assert len(out.block_copies) == 1  # the shared partial block is copied for one of them
    assert bm.block_ids(1)[0] == bm.block_ids(0)[0]  # the full block stays shared
    scheduler.update(out, {0: 9, 1: 10})
    run_to_completion(scheduler)
    assert bm.num_used_blocks == 0


def test_random_lifecycles_with_aborts_end_clean():
    rng = random.Random(1234)
    for mode in ("recompute", "swap"):
        cfg = SchedulerConfig(num_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=24,
                              watermark=0.05, preemption_mode=mode, num_swap_blocks=10 if mode == "swap" else 0,
                              victim_policy=rng.choice(["newest", "priority", "cheapest"]))
        scheduler = Scheduler(cfg)
        model = FakeModel()
        next_id, live = 0, []
        for _ in range(500):
            if rng.random() < 0.6:
                prompt_len, max_tokens = rng.randint(1, 40), rng.randint(1, 30)
                seq = make_seq(next_id, prompt_len, max_tokens, priority=rng.randint(0, 3))
                next_id += 1
                try:
                    scheduler.add(seq)
                    live.append(seq)
                except RequestRejectedError:
                    assert prompt_len + max_tokens > 64 or -(-(prompt_len + max_tokens) // 4) > 24
            if live and rng.random() < 0.15:
                scheduler.abort([rng.choice(live).seq_id])
            out = scheduler.schedule()
            sampled = {i.seq.seq_id: model.sample(i.seq) for i in out.scheduled if i.samples}
            scheduler.update(out, sampled)
            scheduler.check_integrity()
            live = [s for s in live if not s.is_finished]
        run_to_completion(scheduler)
        assert scheduler.block_manager.num_used_blocks == 0
        assert scheduler.block_manager.num_free_swap_blocks == cfg.num_swap_blocks
