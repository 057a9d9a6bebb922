"""Environment switches: each takes its listed values, and anything else is a ConfigError naming the variable."""

import pytest
import torch

from pagedkv.env import env_choice
from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.kernels import resolve_backend


def test_env_choice_reads_checks_and_defaults(monkeypatch):
    monkeypatch.delenv("PAGEDKV_TEST_SWITCH", raising=False)
    assert env_choice("PAGEDKV_TEST_SWITCH", ("a", "b"), "a") == "a"
    assert env_choice("PAGEDKV_TEST_SWITCH", ("a", "b")) is None
    monkeypatch.setenv("PAGEDKV_TEST_SWITCH", "")  # empty counts as unset
    assert env_choice("PAGEDKV_TEST_SWITCH", ("a", "b"), "b") == "b"
    monkeypatch.setenv("PAGEDKV_TEST_SWITCH", "b")
    assert env_choice("PAGEDKV_TEST_SWITCH", ("a", "b"), "a") == "b"
    monkeypatch.setenv("PAGEDKV_TEST_SWITCH", "c")
    with pytest.raises(ConfigError, match="PAGEDKV_TEST_SWITCH must be one of a, b, got 'c'") as info:
        env_choice("PAGEDKV_TEST_SWITCH", ("a", "b"), "a")
    assert isinstance(info.value, PagedKVError)


def test_kernel_backend_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("PAGEDKV_KERNEL_BACKEND", raising=False)
    assert resolve_backend("auto", cpu) == "torch"
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "triton")
    assert resolve_backend("auto", cpu) == "triton"
    assert resolve_backend("torch", cpu) == "torch"  # an explicit backend wins
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "Triton")  # a typo used to fall back to torch silently
    with pytest.raises(ConfigError, match="PAGEDKV_KERNEL_BACKEND"):
        resolve_backend("auto", cpu)


def test_fused_decode_switch(monkeypatch):
    from pagedkv.hf.cache import PagePool

    def pool():
        return PagePool(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)

    monkeypatch.delenv("PAGEDKV_FUSED_DECODE", raising=False)
    assert pool().fused_decode
    monkeypatch.setenv("PAGEDKV_FUSED_DECODE", "0")
    assert not pool().fused_decode
    monkeypatch.setenv("PAGEDKV_FUSED_DECODE", "off")
    with pytest.raises(ConfigError, match="PAGEDKV_FUSED_DECODE must be one of 1, 0, got 'off'"):
        pool()


def test_fp8_switches(monkeypatch):
    from pagedkv.kernels import triton_fp8

    monkeypatch.setenv("PAGEDKV_FP8_COMPUTE", "bf16")
    with pytest.raises(ConfigError, match="PAGEDKV_FP8_COMPUTE must be one of f16, model"):
        triton_fp8._fp8_compute()
    monkeypatch.setenv("PAGEDKV_FP8_CONVERT", "fast")
    with pytest.raises(ConfigError, match="PAGEDKV_FP8_CONVERT must be one of fp32, direct, bits"):
        triton_fp8._fp8_convert_route()
