"""KV tiers under tensor parallelism (two CPU ranks over gloo): each rank offloads and persists its own shard,
and a disk file that is bad on one rank only is a miss on every rank."""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.core.prefix_cache import hash_blocks

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK = 4


def _prompts():
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(3, 500, (24,), generator=gen).tolist()
    return [head + [7, 8, 9], head + [10, 11]]


def _llm(tp, **options):
    return LLM("random:tiny-llama", device="cpu", block_size=BLOCK, num_blocks=64, tensor_parallel_size=tp, **options)


@pytest.mark.parametrize("writer", ["threads", "process"])
def test_tp2_restart_reads_every_ranks_shard_and_a_miss_on_one_rank_is_a_miss_for_all(tmp_path, writer):
    """Each rank writes its shard through its own writer threads or writer process."""
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in _llm(1, enable_prefix_caching=False).generate(prompts, PARAMS)]
    options = dict(kv_offload_memory=64 * 2**10, kv_offload_dir=str(tmp_path), kv_offload_disk_writer=writer)
    first = _llm(2, **options)
    try:
        assert [o.outputs[0].token_ids for o in first.generate(prompts[:1], PARAMS)] == expected[:1]
        rank0_dir = first.engine.runner.offload.disk.dir
    finally:
        first.shutdown()
    shards = sorted(path for path in tmp_path.iterdir() if path.is_dir())
    assert len(shards) == 2 and rank0_dir in shards  # one fingerprint (one shard) per rank
    rank1_dir = next(path for path in shards if path != rank0_dir)
    names = {path.name for path in rank0_dir.iterdir()}
    assert names and names == {path.name for path in rank1_dir.iterdir()}
    # Rank 1's copy of the third block is corrupt; rank 0's is fine: all ranks must treat it as a miss.
    bad = rank1_dir / (hash_blocks(prompts[0], BLOCK)[2].hex() + ".kvb")
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x10
    bad.write_bytes(bytes(data))
    second = _llm(2, **options)
    try:
        assert [o.outputs[0].token_ids for o in second.generate(prompts, PARAMS)] == expected
        stats = second.stats()
        assert stats["kv_disk_load_misses"] == 1 and stats["kv_disk_hit_blocks"] == 2  # the blocks before it
        second.engine.check_integrity()
    finally:
        second.shutdown()
