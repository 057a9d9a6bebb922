"""KV tiers on a model with layer groups (a tiny Gemma 3: 2 sliding layers of window 8, 1 global), on CPU in fp32.

Tiers on == tiers off, greedy and seeded: a pool so small every prefix spills, hits on each tier, preemption,
a restart from disk, a disk file of another layer layout; and what each group keeps in the tiers: the full
group every block of the prefix, a sliding group only the blocks its window needs.
"""

import functools
import logging
import random
import shutil

import pytest

from fuzz_requests import random_lifecycles
from helpers import output_token_ids as _tokens, random_prompts
from pagedkv import LLM, SamplingParams
from pagedkv.core.group_tiers import group_key
from pagedkv.core.hybrid_block_manager import HybridBlockManager
from pagedkv.core.prefix_cache import hash_blocks
from pagedkv.hf import random_model

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def model(window: int = 8):
    return random_model("tiny-gemma3", sliding_window=window)


def _llm(window: int = 8, **options):
    options.setdefault("block_size", BLOCK)
    options.setdefault("num_blocks", 256)
    return LLM(hf_model=model(window), **options)


def _prompts(count=4, seed=3):
    """Prompts over two shared 20-token heads, each with its own tail, longer than the window."""
    heads = random_prompts(2, seed=seed, lengths=(20,))
    tails = random_prompts(count, seed=seed + 1, lengths=(3, 6, 5, 2))
    return [heads[i % 2] + tails[i] for i in range(count)]


def _one_by_one(llm, prompts, params):
    return [llm.generate([p], params)[0] for p in prompts]


@functools.lru_cache(maxsize=None)
def _expected(params_name: str, window: int = 8) -> tuple:
    params = GREEDY if params_name == "greedy" else SEEDED
    return tuple(map(tuple, _tokens(_llm(window, enable_prefix_caching=False).generate(_prompts(), params))))


def _group_blocks(bm: HybridBlockManager, prompts) -> int:
    """Blocks a hit on every prompt's whole hittable prefix takes: all of them in full groups, the window's in
    sliding groups (the rule the GPU prefix cache follows)."""
    total = 0
    for prompt in prompts:
        num_hit = (len(prompt) - 1) // BLOCK
        total += sum(num_hit - group.first_live_block(num_hit * BLOCK, BLOCK) for group in bm.groups)
    return total


@pytest.mark.parametrize("params_name", ["greedy", "seeded"])
def test_every_prefix_spills_and_comes_back_from_the_host(params_name):
    """A pool that holds one request: each prompt's blocks are evicted by the next, and found on the host."""
    params = GREEDY if params_name == "greedy" else SEEDED
    expected = [list(t) for t in _expected(params_name)]
    llm = _llm(num_blocks=24, watermark=0.0, kv_offload_memory=64 * 2**10)
    bm = llm.engine.scheduler.block_manager
    assert type(bm) is HybridBlockManager and [g.sliding_window for g in bm.groups] == [None, 8, 8]
    prompts = _prompts()
    assert _tokens(_one_by_one(llm, prompts, params)) == expected
    first = llm.stats()
    assert first["kv_offloaded_blocks"] > 0
    # Reversed: each prompt's blocks were evicted by the prompts after it; every group's come back from the host.
    outputs = _one_by_one(llm, prompts[::-1], params)[::-1]
    assert _tokens(outputs) == expected
    stats = llm.stats()
    host_hits = stats["kv_host_hit_blocks"] - first["kv_host_hit_blocks"]
    assert host_hits + stats["kv_gpu_hit_blocks"] - first["kv_gpu_hit_blocks"] == _group_blocks(bm, prompts)
    assert host_hits >= _group_blocks(bm, prompts[2:3])  # prompt 2's head was evicted by head 1's prompts
    assert all(o.num_cached_tokens == (len(o.prompt_token_ids) - 1) // BLOCK * BLOCK for o in outputs)
    assert stats["num_used_blocks"] == 0
    llm.engine.check_integrity()


def test_tiers_keep_a_sliding_group_only_where_a_window_needs_it():
    """Host keys are per group: every full-group block of the prefix, and of a sliding group at least the window
    a hit at the prompt's end needs (the tiers hold what the GPU cache held, which is no less)."""
    llm = _llm(num_blocks=24, watermark=0.0, kv_offload_memory=64 * 2**10)
    prompt, other = _prompts(2)
    llm.generate([prompt], GREEDY)
    llm.generate([other], GREEDY)  # evicts the first prompt's blocks to the host
    bm = llm.engine.scheduler.block_manager
    host = bm.tiers.host
    keys = hash_blocks(prompt, BLOCK)[:(len(prompt) - 1) // BLOCK]
    assert all(group_key(key, 0) in host for key in keys)  # the full group: the whole prefix
    for g in (1, 2):
        first = bm.groups[g].first_live_block(len(keys) * BLOCK, BLOCK)
        assert all(group_key(key, g) in host for key in keys[first:])
    assert len({group_key(keys[0], g) for g in range(3)}) == 3  # one key per group: never mixed up
    llm.engine.check_integrity()


@pytest.mark.parametrize("mode, params_name", [("recompute", "greedy"), ("swap", "seeded")])
def test_tiers_equal_no_tiers_under_preemption(mode, params_name):
    params = GREEDY if params_name == "greedy" else SEEDED
    long = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed, max_tokens=12,
                          ignore_eos=True)
    prompts = _prompts()
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, long))
    small = _llm(num_blocks=28, watermark=0.0, max_num_batched_tokens=16, preemption_mode=mode,
                 swap_space=8 * 2**10, kv_offload_memory=64 * 2**10)
    assert _tokens(small.generate(prompts, long)) == expected
    assert _tokens(small.generate(prompts, long)) == expected  # again, with hits in the tiers
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_offloaded_blocks"] > 0 and stats["kv_host_hit_blocks"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]
    assert stats["num_used_blocks"] == 0
    small.engine.check_integrity()


def _disk_llm(directory, window=8, **options):
    options.setdefault("num_blocks", 64)
    return _llm(window, kv_offload_memory=64 * 2**10, kv_offload_dir=str(directory), **options)


def test_a_restart_serves_prompt_blocks_of_every_group_from_disk(tmp_path):
    prompts = _prompts()
    expected = [list(t) for t in _expected("greedy")]
    first = _disk_llm(tmp_path)
    assert _tokens(first.generate(prompts, GREEDY)) == expected
    first.engine.shutdown()
    second = _disk_llm(tmp_path)
    bm = second.engine.scheduler.block_manager
    assert bm.tiers.disk.num_blocks > 0
    assert _tokens(_one_by_one(second, prompts[:1], GREEDY)) == expected[:1]
    assert second.stats()["kv_disk_hit_blocks"] == _group_blocks(bm, prompts[:1])  # every group's, all from disk
    assert _tokens(_one_by_one(second, prompts[1:], GREEDY)) == expected[1:]
    stats = second.stats()
    # Every block a hit needs came from disk or, shared by an earlier prompt, from the GPU.
    assert stats["kv_disk_hit_blocks"] + stats["kv_gpu_hit_blocks"] == _group_blocks(bm, prompts)
    assert stats["kv_disk_load_misses"] == 0 and stats["kv_host_hit_blocks"] == 0
    second.engine.check_integrity()


def test_a_file_of_another_layer_layout_is_a_miss(tmp_path, caplog):
    """The same weights with another window: the same block bytes and names, but the fingerprint differs."""
    prompts = _prompts(2)
    expected = [list(t) for t in _expected("greedy", 4)[:2]]
    first = _disk_llm(tmp_path / "a")
    first.generate(prompts, GREEDY)
    first.engine.shutdown()
    other = _disk_llm(tmp_path / "b", window=4)
    directory = other.engine.runner.offload.disk.dir
    other.engine.shutdown()
    files = list(first.engine.runner.offload.disk.dir.glob("*.kvb"))
    assert files and first.engine.runner.offload.disk.dir.name != directory.name
    for path in files:
        shutil.copy(path, directory / path.name)
    second = _disk_llm(tmp_path / "b", window=4)
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert _tokens(_one_by_one(second, prompts, GREEDY)) == expected
    stats = second.stats()
    assert stats["kv_disk_load_misses"] > 0 and stats["kv_disk_hit_blocks"] == 0
    assert any("another model or config" in r.getMessage() for r in caplog.records)
    second.engine.check_integrity()


def test_host_pool_stays_bounded_over_requests_with_aborts(tmp_path):
    rng = random.Random(4)
    llm = _disk_llm(tmp_path, num_blocks=40, watermark=0.05, max_num_batched_tokens=16, max_num_seqs=6,
                    preemption_mode="swap", swap_space=4 * 2**10, kv_offload_disk_bytes=64 * 2**10)
    engine = llm.engine
    heads = random_prompts(4, seed=9, lengths=(12, 20, 9, 16))
    random_lifecycles(engine, rng, 60, lambda r: r.choice(heads) + [r.randint(3, 499) for _ in range(r.randint(1, 5))],
                      5, quiet_limit=10)
    tiers = engine.scheduler.block_manager.tiers
    engine.scheduler.block_manager.begin_step()
    engine.check_integrity()
    assert tiers.host.allocator.num_used == tiers.host.num_cached  # only cached blocks remain: no swap leak
    stats = llm.stats()
    assert stats["kv_host_hit_blocks"] > 0 and stats["num_used_blocks"] == 0
    engine.shutdown()
    assert len(list(tmp_path.rglob("*.kvb"))) <= tiers.disk.capacity_blocks
