"""KV tiers through the engine on CPU: offload on == off, hits on each tier, restart from disk, tampering,
a bounded host pool, and a disk that cannot be written."""

import errno
import logging
import os
import random

import pytest
import torch

from fuzz_requests import random_lifecycles
from helpers import tiny
from pagedkv import LLM, SamplingParams
from pagedkv.core.prefix_cache import hash_blocks
from pagedkv.errors import ConfigError
from pagedkv.engine.config import EngineConfig

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=4, ignore_eos=True)


def _llm(**options):
    options.setdefault("block_size", BLOCK)
    options.setdefault("num_blocks", 512)
    return LLM(hf_model=tiny(options.pop("name", "tiny-llama")), **options)


def _chat_prompts(num_heads=3, per_head=3, head_len=24, seed=0):
    """Prompts over a few shared 'system prompts' (heads) with their own tails, interleaved."""
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, 500, (head_len,), generator=gen).tolist() for _ in range(num_heads)]
    return [heads[h] + torch.randint(3, 500, (3 + i,), generator=gen).tolist()
            for i in range(per_head) for h in range(num_heads)]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _hittable_blocks(prompts):
    return sum((len(p) - 1) // BLOCK for p in prompts)


def _one_by_one(llm, prompts, params):
    return [llm.generate([p], params)[0] for p in prompts]


@pytest.mark.parametrize("mode, params", [("recompute", "greedy"), ("swap", "seeded")])
def test_offload_equals_no_offload_under_preemption(mode, params):
    params = GREEDY if params == "greedy" else SEEDED
    prompts = _chat_prompts(num_heads=2, per_head=2, head_len=12)
    long = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed, max_tokens=10,
                          ignore_eos=True)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, long))
    small = _llm(num_blocks=9, watermark=0.0, max_num_batched_tokens=32, preemption_mode=mode,
                 swap_space=32 * 2**10, kv_offload_memory=256 * 2**10)
    assert _tokens(small.generate(prompts, long)) == expected
    assert _tokens(small.generate(prompts, long)) == expected  # again, now with hits on the host tier
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_offloaded_blocks"] > 0 and stats["kv_host_hit_blocks"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0
    assert stats["num_used_blocks"] == 0
    small.engine.check_integrity()


def test_every_prefix_spills_when_the_pool_holds_one_request():
    prompts = _chat_prompts(num_heads=4, per_head=1, head_len=20)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = _llm(num_blocks=9, watermark=0.0, kv_offload_memory=512 * 2**10)
    assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected
    first = llm.stats()
    assert first["kv_host_hit_blocks"] == 0 and first["kv_offloaded_blocks"] > 0
    assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected
    stats = llm.stats()
    # Each prompt's full blocks were evicted by the next prompt: the second pass finds them all on the host.
    assert stats["kv_host_hit_blocks"] == _hittable_blocks(prompts)
    assert stats["kv_h2d_bytes"] == stats["kv_restored_blocks"] * llm.engine.pool.bytes_per_block
    # A prefix spilled tail first sits on consecutive host blocks: restored with one copy, not one per block.
    assert stats["kv_h2d_num_copies"] == len(prompts)
    llm.engine.check_integrity()


@pytest.mark.parametrize("options, where, params", [
    (dict(max_num_batched_tokens=64), "in the step", "greedy"),
    (dict(max_num_batched_tokens=8), "beside the step", "seeded"),
    (dict(max_num_batched_tokens=64, kv_offload_in_step_restore_tokens=0), "beside the step", "greedy"),
])
def test_restored_requests_compute_the_same_tokens_in_their_step_or_the_next(options, where, params):
    """Restores within the step's budget (its tokens' worth of blocks, or kv_offload_in_step_restore_tokens)
    are copied before its kernels; a budget of 8 tokens (2 blocks) sends the longer restores beside the step,
    and an in-step budget of 0 every restore. Tokens as without tiers, either way."""
    params = GREEDY if params == "greedy" else SEEDED
    prompts = _chat_prompts(num_heads=3, per_head=1, head_len=20)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, params))
    llm = _llm(num_blocks=9, watermark=0.0, kv_offload_memory=512 * 2**10, **options)
    restored = {"in the step": 0, "beside the step": 0}
    move = llm.engine.runner.offload.move

    def counting_move(step):
        restored["in the step"] += len(step.restore_in_step)
        restored["beside the step"] += len(step.restore)
        move(step)

    llm.engine.runner.offload.move = counting_move
    assert _tokens(_one_by_one(llm, prompts, params)) == expected
    assert _tokens(_one_by_one(llm, prompts, params)) == expected  # every prefix restored from the host
    assert restored[where] > 0 and restored[where] >= llm.stats()["kv_restored_blocks"] // 2
    if options.get("kv_offload_in_step_restore_tokens") == 0:
        assert restored["in the step"] == 0
    llm.engine.check_integrity()


def _disk_llm(directory, **options):
    options.setdefault("num_blocks", 64)
    return _llm(kv_offload_memory=64 * 2**10, kv_offload_dir=str(directory), **options)


def test_restart_serves_every_prompt_block_from_disk(tmp_path):
    prompts = _chat_prompts(num_heads=2, per_head=2)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, GREEDY))
    first = _disk_llm(tmp_path)
    assert _tokens(first.generate(prompts, GREEDY)) == expected
    first.engine.shutdown()
    order = first.engine.scheduler.block_manager.tiers.disk.keys()
    second = _disk_llm(tmp_path)
    # the restart indexes the files in the LRU order the first engine's disk tier kept (not in write order)
    assert second.engine.scheduler.block_manager.tiers.disk.keys() == order and order
    assert _tokens(_one_by_one(second, prompts, GREEDY)) == expected
    stats = second.stats()
    # The first prompt of each head loads its blocks from disk; its sibling then shares them on the GPU.
    assert stats["kv_disk_hit_blocks"] + stats["kv_gpu_hit_blocks"] == _hittable_blocks(prompts)
    assert stats["kv_disk_hit_blocks"] == _hittable_blocks(prompts[:2]) and stats["kv_disk_load_misses"] == 0
    second.engine.check_integrity()


def test_a_restart_indexes_the_disk_in_the_lru_order_the_tiers_kept(tmp_path):
    """A file hit since it was written counts as recent after a restart too (a shutdown sets the files'
    modification times in the disk tier's LRU order), not as old as its write."""
    prompts = _chat_prompts(num_heads=3, per_head=1, head_len=24)
    first = _disk_llm(tmp_path, num_blocks=16)
    for prompt in prompts:  # each evicts the one before it: its blocks spill, and are written
        first.generate([prompt], GREEDY)
    first.generate([prompts[0]], GREEDY)  # the first prompt again: its files, written first, are used last
    first.engine.shutdown()
    order = first.engine.scheduler.block_manager.tiers.disk.keys()
    keys = [hash_blocks(p, BLOCK)[:(len(p) - 1) // BLOCK] for p in prompts]
    assert min(order.index(key) for key in keys[0]) > max(order.index(key) for key in keys[1])
    second = _disk_llm(tmp_path, num_blocks=16)
    assert second.engine.scheduler.block_manager.tiers.disk.keys() == order


def test_disk_reads_run_on_reader_threads_and_are_collected_after_the_launch(tmp_path):
    import threading

    prompt = _chat_prompts(num_heads=1, per_head=1)[0]
    expected = _tokens(_llm(enable_prefix_caching=False).generate([prompt], GREEDY))
    first = _disk_llm(tmp_path)
    first.generate([prompt], GREEDY)
    first.engine.shutdown()
    second = _disk_llm(tmp_path)
    offload, runner = second.engine.runner.offload, second.engine.runner
    events = []
    load, execute, finish = offload.disk.load, runner._execute, offload.finish_loads

    def reading(key, out):
        events.append(("read", threading.current_thread() is threading.main_thread()))
        return load(key, out)

    def launching(step, previous_tokens):
        result = execute(step, previous_tokens)
        events.append(("launched", bool(step.disk_loads)))
        return result

    def finishing(failed=False, wait=True):
        events.append(("finish", bool(offload.io._reading)))
        finish(failed, wait)

    offload.disk.load, runner._execute, offload.finish_loads = reading, launching, finishing
    assert _tokens(second.generate([prompt], GREEDY)) == expected
    reads = [on_main for what, on_main in events if what == "read"]
    assert len(reads) == second.stats()["kv_disk_hit_blocks"] == _hittable_blocks([prompt])
    assert not any(reads)  # every file was read off the engine's thread
    steps = [event for event in events if event[0] != "read"]
    assert steps.count(("launched", True)) == 1  # one step read the prefix, and collected it after its launch
    assert steps[steps.index(("launched", True)) + 1] == ("finish", True)
    second.engine.check_integrity()


def _restarted_with_a_prompt_on_disk(tmp_path):
    """(engine restarted on tmp_path, a prompt whose blocks are on disk, a prompt sharing nothing with it)."""
    on_disk, fresh = _chat_prompts(num_heads=2, per_head=1)
    first = _disk_llm(tmp_path)
    first.generate([on_disk], GREEDY)
    first.engine.shutdown()
    return _disk_llm(tmp_path).engine, on_disk, fresh


def _finish_and_check(engine, expected, on_disk):
    """Run `engine` dry: "disk" and "fresh" give the `expected` tokens, the first from disk; every tier clean."""
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update((out.request_id, out.outputs[0].token_ids) for out in engine.step() if out.finished)
    assert [tokens["disk"], tokens["fresh"]] == expected
    assert engine.stats().kv_disk_hit_blocks == _hittable_blocks([on_disk])
    engine.check_integrity()


def test_a_prompt_loading_from_disk_does_not_hold_up_the_prompts_behind_it(tmp_path):
    engine, on_disk, fresh = _restarted_with_a_prompt_on_disk(tmp_path)
    expected = _tokens(_llm(enable_prefix_caching=False).generate([on_disk, fresh], GREEDY))
    engine.add_request("disk", on_disk, GREEDY)
    engine.add_request("fresh", fresh, GREEDY)
    engine.step()  # starts the disk reads of the first prompt, and admits the second meanwhile
    assert [seq.request_id for seq in engine.scheduler.running] == ["fresh"]
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["disk"]
    _finish_and_check(engine, expected, on_disk)


def test_a_slow_disk_read_holds_up_no_step(tmp_path):
    import threading

    engine, on_disk, fresh = _restarted_with_a_prompt_on_disk(tmp_path)
    longer = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = _llm(enable_prefix_caching=False)
    expected = _tokens(reference.generate([on_disk], GREEDY) + reference.generate([fresh], longer))
    offload = engine.runner.offload
    release, read_done, load = threading.Event(), threading.Event(), offload.disk.load

    def slow_load(key, out):
        release.wait(timeout=5)  # bounded, so that an engine that waits for its reads fails rather than hangs
        ok = load(key, out)
        read_done.set()
        return ok

    offload.disk.load = slow_load
    engine.add_request("fresh", fresh, longer)
    engine.step()
    engine.add_request("disk", on_disk, GREEDY)
    engine.step()  # starts the reads; they are still blocked when the step returns, and "fresh" ran on
    engine.step()
    assert not read_done.is_set() and [seq.request_id for seq in engine.scheduler.waiting] == ["disk"]
    assert engine.requests["fresh"].seqs[0].num_output_tokens >= 2
    release.set()
    _finish_and_check(engine, expected, on_disk)


def test_a_read_of_a_block_whose_write_is_still_queued_waits_for_it(tmp_path):
    import threading

    import numpy as np

    from pagedkv.engine.kv_disk import DiskStore

    store = DiskStore(tmp_path, "ab" * 32, 64, num_write_threads=1)
    gate, entered, path = threading.Event(), threading.Event(), store.path
    blocks = [np.full(64, value, dtype=np.uint8) for value in (1, 2)]
    store.write_async(b"a" * 32, blocks[0], gate.wait)  # holds the writer: the second write stays queued
    store.write_async(b"b" * 32, blocks[1])
    store.path = lambda key: entered.set() or path(key)
    out, result = np.zeros(64, dtype=np.uint8), []
    reader = threading.Thread(target=lambda: result.append(store.load(b"b" * 32, out)))
    reader.start()
    entered.wait()
    gate.set()
    reader.join()
    assert result == [True] and (out == 2).all()
    store.close()


def test_writer_threads_keep_each_keys_write_and_delete_in_order(tmp_path):
    import numpy as np

    from pagedkv.engine.kv_disk import DiskStore

    store = DiskStore(tmp_path, "cd" * 32, 64, num_write_threads=4)
    keys = [bytes([index]) * 32 for index in range(64)]
    for index, key in enumerate(keys):  # every key written, every other one deleted right after
        store.write_async(key, np.full(64, index, dtype=np.uint8))
        if index % 2:
            store.delete_async(key)
    store.flush()
    assert sorted(store.scan()) == sorted(keys[0::2])
    assert sorted(key for key, ok in store.poll() if ok) == sorted(keys)
    out = np.zeros(64, dtype=np.uint8)
    assert store.load(keys[4], out) and (out == 4).all()
    store.close()
    store.close()  # idempotent


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities on this platform")
def test_writer_threads_run_nicer_than_the_step_loop(tmp_path):
    import numpy as np

    from pagedkv.engine.kv_disk import DiskStore

    store = DiskStore(tmp_path, "ef" * 32, 64, num_write_threads=2)
    store.write_async(b"\1" * 32, np.zeros(64, dtype=np.uint8))
    store.flush()  # the threads have set their priority before their first job
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if own >= 19:
        pytest.skip("this process already runs at the lowest priority")
    assert all(os.getpriority(os.PRIO_PROCESS, thread.native_id) > own for thread in store._threads)
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the process (and its step loop) keeps its priority
    store.close()


def _file_of(llm, prompt, index):
    from pagedkv.core.prefix_cache import hash_blocks

    key = hash_blocks(prompt, BLOCK)[index]
    return llm.engine.runner.offload.disk.path(key)


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("tamper", ["truncate", "flip", "foreign"])
def test_tampered_files_are_misses_with_a_log_line(tmp_path, caplog, tamper):
    prompt = _chat_prompts(num_heads=1, per_head=1)[0]
    expected = _tokens(_llm(enable_prefix_caching=False).generate([prompt], GREEDY))
    first = _disk_llm(tmp_path / "a")
    first.generate([prompt], GREEDY)
    first.engine.shutdown()
    target = _file_of(first, prompt, 2)
    if tamper == "truncate":
        _truncate(target)
    elif tamper == "flip":
        _flip_byte(target)
    else:  # the same block (same tokens, same key) written by another model, put in its place
        other = _disk_llm(tmp_path / "b", name="tiny-qwen3")
        other.generate([prompt], GREEDY)
        other.engine.shutdown()
        target.write_bytes(_file_of(other, prompt, 2).read_bytes())
    second = _disk_llm(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert _tokens(second.generate([prompt], GREEDY)) == expected
    assert any(target.name in r.getMessage() and "miss" in r.getMessage() for r in caplog.records)
    stats = second.stats()
    assert stats["kv_disk_load_misses"] == 1 and stats["kv_disk_hit_blocks"] == 2  # the blocks before it
    second.engine.check_integrity()


def test_an_unwritable_directory_turns_the_disk_tier_off(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    prompts = _chat_prompts(num_heads=2, per_head=2)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, GREEDY))
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        llm = _disk_llm(blocker / "kv", num_blocks=12)
    assert any("KV disk tier off" in r.getMessage() for r in caplog.records)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.block_manager.tiers.disk is None
    llm.engine.shutdown()
    llm.engine.check_integrity()


def test_a_full_disk_turns_the_disk_tier_off_and_serving_goes_on(tmp_path, caplog, monkeypatch):
    prompts = _chat_prompts(num_heads=3, per_head=2)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = _disk_llm(tmp_path, num_blocks=12)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected
        llm.engine.runner.offload.disk.flush()
        llm.generate(prompts[:1], GREEDY)  # the next step hears of it
    assert any("KV disk tier off" in r.getMessage() for r in caplog.records)
    assert llm.engine.scheduler.block_manager.tiers.disk is None
    assert not list(tmp_path.rglob("*.kvb"))
    llm.engine.check_integrity()


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=64), dict(max_num_batched_tokens=8)],
                         ids=["in the step", "beside the step"])
def test_early_restores_compute_the_same_tokens(options):
    """With `kv_offload_early_restore` the scheduler hands each restore's host blocks to the runner before it
    evicts and allocates, and the step scatters the staged blocks: every restore goes that way (counted), the
    tokens are those without tiers, and the copy statistics are the usual ones (one copy per run of host blocks)."""
    prompts = _chat_prompts(num_heads=3, per_head=2, head_len=20)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = _llm(num_blocks=9, watermark=0.0, kv_offload_memory=512 * 2**10, kv_offload_early_restore=True, **options)
    offload = llm.engine.runner.offload
    staged, stage = [], offload.stage_restore
    llm.engine.scheduler.block_manager.tiers.stage_restore = lambda blocks: (staged.append(len(blocks)), stage(blocks))
    assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected
    assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected  # the prefixes restored from the host
    stats = llm.stats()
    assert stats["kv_restored_blocks"] > 0 and sum(staged) == stats["kv_restored_blocks"]
    assert stats["kv_h2d_bytes"] == stats["kv_restored_blocks"] * llm.engine.pool.bytes_per_block
    assert stats["kv_h2d_num_copies"] == len(staged)  # each prefix spilled tail first: one run of host blocks
    assert not offload._early
    llm.engine.check_integrity()


def test_an_early_restore_the_step_does_not_claim_is_dropped():
    """A restore staged for an admission that did not go through (the step names none of its blocks, or only
    some) is never scattered: the step's own copies are as without it, and the next step starts clean."""
    from pagedkv.engine.kv_offload import _claim, _Staged

    entry = _Staged([5, 6], torch.zeros(2), None, None)
    other = _Staged([9], torch.zeros(1), None, None)
    early = [entry, other]
    rest, claimed = _claim(early, [(5, 50), (6, 60), (7, 70)])
    assert rest == [(7, 70)] and claimed == [(entry, [50, 60])] and early == [other]
    assert _claim([_Staged([5, 8], torch.zeros(2), None, None)], [(5, 50)]) == ([(5, 50)], [])
    prompts = _chat_prompts(num_heads=2, per_head=1, head_len=20)
    llm = _llm(num_blocks=9, watermark=0.0, kv_offload_memory=512 * 2**10, kv_offload_early_restore=True)
    expected = _tokens(_one_by_one(llm, prompts, GREEDY))
    offload = llm.engine.runner.offload
    offload.stage_restore([0, 1])  # as if an admission had staged host blocks 0 and 1, then backed out
    assert len(offload._early) == 1
    assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected
    assert not offload._early
    llm.engine.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_write_through_keeps_tokens_and_takes_the_copies_off_the_evictions(mode):
    """`kv_offload_write_through`: each committed block goes to the host tier in the steps after it, so the
    evictions of a pool too small for two prompts spill fewer blocks than without it; the tokens are those
    without tiers (greedy, under preemption), and the copies ahead of eviction are counted apart."""
    prompts = _chat_prompts(num_heads=3, per_head=2, head_len=20)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, params))
    spills = {}
    for write_through in (False, True):
        llm = _llm(num_blocks=9, watermark=0.0, max_num_batched_tokens=16, preemption_mode=mode,
                   swap_space=32 * 2**10, kv_offload_memory=512 * 2**10, kv_offload_write_through=write_through)
        llm.engine.step_timings = []
        assert _tokens(_one_by_one(llm, prompts, params)) == expected
        assert _tokens(llm.generate(prompts, params)) == expected  # together: preemption, hits on the host
        shapes = [timing.shape for timing in llm.engine.step_timings]
        spills[write_through] = (sum(s.offloaded_blocks for s in shapes), sum(s.pre_spilled_blocks for s in shapes))
        assert llm.stats()["kv_restored_blocks"] > 0
        llm.engine.check_integrity()
    assert spills[True][0] < spills[False][0] and spills[True][1] > spills[False][1], spills
    with pytest.raises(ConfigError, match="kv_offload_write_through"):
        EngineConfig(kv_offload_write_through=1)


def test_early_restore_is_on_by_default_and_its_flag_is_checked():
    llm = _llm(kv_offload_memory=512 * 2**10)
    assert llm.engine.scheduler.block_manager.tiers.stage_restore == llm.engine.runner.offload.stage_restore
    with pytest.raises(ConfigError, match="kv_offload_early_restore"):
        EngineConfig(kv_offload_early_restore="yes")


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=64), dict(max_num_batched_tokens=8)],
                         ids=["in the step", "beside the step"])
def test_restores_issued_with_the_step_compute_the_same_tokens(options):
    """`kv_offload_early_restore=False`: no restore is staged at admission; the step's moves copy them (in the
    step, or beside it with the requests computing from the next step), and the tokens are those without tiers."""
    prompts = _chat_prompts(num_heads=3, per_head=2, head_len=20)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = _llm(num_blocks=9, watermark=0.0, kv_offload_memory=512 * 2**10, kv_offload_early_restore=False, **options)
    assert llm.engine.scheduler.block_manager.tiers.stage_restore is None
    assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected
    assert _tokens(_one_by_one(llm, prompts, GREEDY)) == expected  # the prefixes restored from the host
    assert llm.stats()["kv_restored_blocks"] > 0
    llm.engine.check_integrity()


def test_host_pool_stays_bounded_over_requests_with_aborts(tmp_path):
    """120 requests here (the model's steps are what costs); tests/core/test_kv_tiers.py runs 1,000 through the
    same bookkeeping without a model."""
    rng = random.Random(3)
    llm = _disk_llm(tmp_path, num_blocks=20, watermark=0.05, max_num_batched_tokens=32, max_num_seqs=8,
                    preemption_mode="swap", swap_space=16 * 2**10, kv_offload_disk_bytes=128 * 2**10)
    engine = llm.engine
    heads = [[rng.randint(3, 499) for _ in range(rng.randint(4, 16))] for _ in range(6)]
    random_lifecycles(engine, rng, 120, lambda r: r.choice(heads) + [r.randint(3, 499) for _ in range(r.randint(1, 6))],
                      4, quiet_limit=6)
    tiers = engine.scheduler.block_manager.tiers
    tiers.begin_step()
    engine.check_integrity()
    assert tiers.host.allocator.num_used == tiers.host.num_cached  # only cached blocks remain: no swap leak
    assert tiers.disk.num_blocks <= tiers.disk.capacity_blocks
    stats = llm.stats()
    assert stats["kv_host_hit_blocks"] > 0 and stats["num_used_blocks"] == 0
    engine.shutdown()
    assert len(list(tmp_path.rglob("*.kvb"))) <= tiers.disk.capacity_blocks


@pytest.mark.parametrize("options, match", [
    (dict(kv_offload_memory=-1), "kv_offload_memory"),
    (dict(kv_offload_memory=1.5), "kv_offload_memory"),
    (dict(kv_offload_dir="/tmp/x"), "kv_offload_memory"),
    (dict(kv_offload_memory=2**20, kv_offload_dir=""), "kv_offload_dir"),
    (dict(kv_offload_memory=2**20, kv_offload_in_step_restore_tokens=-16), "kv_offload_in_step_restore_tokens"),
])
def test_bad_offload_config_names_the_field(options, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**options)


def test_a_host_tier_smaller_than_a_block_is_refused():
    with pytest.raises(ConfigError, match="kv_offload_memory 16 bytes holds no block"):
        _llm(kv_offload_memory=16)


#: GPU pools per model: small enough that prefixes spill and sequences swap, large enough for one request. A layer
#: group model (tiny Gemma 3: window 8, 2 sliding layers to 1 global) keeps a table per group over the same pool.
GPU_POOLS = {"tiny-qwen3": dict(num_blocks=48), "tiny-gemma3": dict(num_blocks=72, max_num_batched_tokens=32)}


@pytest.mark.gpu
@pytest.mark.parametrize("name, writer, early, write_through",
                         [(name, "threads", True, False) for name in GPU_POOLS]
                         + [("tiny-qwen3", "process", True, False), ("tiny-qwen3", "threads", False, False),
                            ("tiny-qwen3", "threads", True, True), ("tiny-gemma3", "threads", True, True)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_cuda_side_stream_copies_keep_tokens_and_survive_a_restart(tmp_path, kv_cache_dtype, name, writer, early,
                                                                    write_through):
    """The CUDA path: spills, pre-spills and restores on the side stream beside graphed steps, swap through the
    same pool, disk writes after a CUDA event, then a restart: the tokens of a pool with no tiers, every time.
    For the layer-group model every group's blocks take that path, keyed per group. With the writer process
    the host pool is shared memory registered with CUDA (pinned), and its writes wait for their copies'
    events. With early restores (the default) the restores' copies start at admission, before the step's other
    copies; without, they go with the step's moves. With write-through the committed blocks go to the host in
    the steps after their kernels, read by the copy stream after its wait for the main stream."""
    from pagedkv.models.loader import random_model

    model = random_model(name, torch.float32, "cuda")
    prompts = _chat_prompts(num_heads=4, per_head=3, head_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = dict(hf_model=model, block_size=BLOCK, max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    expected = _tokens(LLM(num_blocks=2048, enable_prefix_caching=False, **options).generate(prompts, params))
    tiers = dict(kv_offload_memory=8 * 2**20, kv_offload_dir=str(tmp_path), watermark=0.0,
                 preemption_mode="swap", swap_space=2**20, kv_offload_disk_writer=writer,
                 kv_offload_early_restore=early, kv_offload_write_through=write_through, **GPU_POOLS[name])
    first = LLM(**options, **tiers)
    if writer == "process":
        from pagedkv.engine.kv_disk_process import ProcessDiskStore

        assert isinstance(first.engine.runner.offload.disk, ProcessDiskStore)
        assert first.engine.runner.offload.host.is_pinned()
    assert first.engine.runner.graphs
    assert first.engine.scheduler.block_manager.num_groups == (3 if name == "tiny-gemma3" else 1)
    assert _tokens(first.generate(prompts, params)) == expected
    assert _tokens(_one_by_one(first, prompts, params)) == expected  # host hits restored beside the steps
    stats = first.stats()
    assert stats["kv_host_hit_blocks"] > 0 and stats["kv_h2d_seconds"] > 0 and stats["num_swap_outs"] > 0
    first.shutdown()
    second = LLM(**options, **tiers)
    assert _tokens(_one_by_one(second, prompts, params)) == expected
    assert second.stats()["kv_disk_hit_blocks"] > 0 and second.stats()["kv_disk_load_misses"] == 0
    second.engine.check_integrity()
