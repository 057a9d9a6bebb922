"""`ReplicaStatsSum`: the replicas' engine stats summed, read as attributes or a dict, and picklable."""

import pickle

import pytest

from pagedkv.distributed.replica_process import ReplicaStatsSum

A = {"num_blocks": 64, "num_used_blocks": 10, "block_size": 16, "tokens_per_second": 100.0, "num_preemptions": 2}
B = {"num_blocks": 64, "num_used_blocks": 5, "block_size": 16, "tokens_per_second": 50.0, "num_preemptions": 1}


def test_sums_every_live_replica_and_keeps_each_ones_own():
    stats = ReplicaStatsSum([A, None, B])  # a replica with no stats yet (starting) counts for nothing
    assert (stats.num_blocks, stats.num_used_blocks, stats.num_preemptions) == (128, 15, 3)
    assert stats.block_size == 16 and stats.tokens_per_second == 150.0
    assert stats.per_replica == [A, None, B]
    with pytest.raises(AttributeError):
        stats.num_unknown


def test_as_dict_is_a_copy_and_the_sum_survives_pickling():
    stats = ReplicaStatsSum([A, B])
    stats.as_dict()["num_blocks"] = 0  # a caller's edit does not reach the next read
    assert stats.num_blocks == 128 and stats.as_dict()["num_blocks"] == 128
    again = pickle.loads(pickle.dumps(stats))
    assert again.num_used_blocks == 15 and again.as_dict() == stats.as_dict()
