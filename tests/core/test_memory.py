"""Memory accounting and the deterministic workload."""

import pytest

from pagedkv import InvalidArgumentError, ModelSpec, generate_lengths, memory_report
from pagedkv.core.workload import SplitMix64


def test_worked_example():
    report = memory_report([1, 16, 17, 100], block_size=16, max_seq_len=128)
    assert report.num_blocks == 11  # 1 + 1 + 2 + 7
    assert report.fragmentation_tokens == 42  # 15 + 0 + 15 + 12
    assert report.stored_tokens == 134
    assert report.paged_reserved_tokens == 176
    assert report.naive_reserved_tokens == 4 * 128
    assert report.paged_utilization == pytest.approx(134 / 176)


def test_bytes_per_token_formula():
    llama3_70b = ModelSpec(num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert llama3_70b.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB
    report = memory_report([10, 20], block_size=16, max_seq_len=64, bytes_per_token=llama3_70b.bytes_per_token)
    assert report.paged_reserved_bytes == 48 * 327_680  # ceil(10/16) + ceil(20/16) = 3 blocks
    assert report.naive_reserved_bytes == 128 * 327_680


def test_fragmentation_is_about_half_a_block():
    lengths = generate_lengths(4000, seed=3)
    report = memory_report(lengths, block_size=16, max_seq_len=2048)
    assert report.fragmentation_per_seq == pytest.approx(7.5, abs=0.5)


def test_bad_inputs():
    with pytest.raises(InvalidArgumentError):
        memory_report([5], block_size=0, max_seq_len=8)
    with pytest.raises(InvalidArgumentError, match="over max_seq_len"):
        memory_report([9], block_size=4, max_seq_len=8)
    with pytest.raises(InvalidArgumentError):
        ModelSpec(num_layers=0, num_kv_heads=1, head_dim=1, dtype_bytes=2)


def test_workload_is_deterministic_and_matches_the_mix():
    assert generate_lengths(200, seed=7) == generate_lengths(200, seed=7)
    assert generate_lengths(200, seed=7) != generate_lengths(200, seed=8)
    lengths = generate_lengths(10_000, seed=1)
    short = sum(32 <= n <= 128 for n in lengths) / len(lengths)
    medium = sum(256 <= n <= 512 for n in lengths) / len(lengths)
    long = sum(1024 <= n <= 2048 for n in lengths) / len(lengths)
    assert (short, medium, long) == pytest.approx((0.5, 0.3, 0.2), abs=0.02)
    assert short + medium + long == 1.0


def test_splitmix64_reference_values():
    # Published first outputs of SplitMix64 seeded with 0 (used by xoshiro's reference seeding),
    # so lengths cannot silently change between platforms or Python versions.
    rng = SplitMix64(0)
    assert [rng.next_u64() for _ in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
