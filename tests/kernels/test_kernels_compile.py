"""The Triton kernels compile for sm_90 (H100 / H200) on this GPU-less machine, and fit the SM as the launchers assume.

The interpreter never compiles, so this is the CPU suite's only guard against a kernel that
computes right but cannot be built: a persistent decode loop once crashed Triton's software
pipeliner. It runs `pagedkv.kernels.offline_compile` in a subprocess, because the test
session's TRITON_INTERPRET=1 (tests/conftest.py) is fixed when Triton is first imported.
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's NVIDIA backend (ptxas) is not installed")


@pytest.fixture(scope="module")
def compiled():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "pagedkv.kernels.offline_compile", "--json"], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.stdout, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled):
    failed = {row["case"]: row["error"] for row in compiled if row["error"]}
    assert not failed, failed
    kernels = {row["kernel"] for row in compiled}
    assert {"_decode_kernel", "_merge_kernel", "_prefill_kernel", "_unified_kernel",
            "_write_kv_kernel", "_decode_write_kernel", "_split_prefill_kernel",
            "_packed_prefill_kernel", "_gluon_prefill_kernel"} <= kernels
    # The decode loops are software-pipelined (cp.async into shared memory), not plain loads.
    assert all(row["async_copies"] > 0 for row in compiled if "decode" in row["kernel"] and "merge" not in
               row["kernel"])


def test_in_kernel_merge_keeps_the_split_kernels_occupancy(compiled):
    residency = {row["case"]: row["residency"] for row in compiled if row["kernel"] == "_decode_kernel"}
    assert residency["decode in-kernel merge llama3"] == residency["decode split llama3"] == 4


def test_fused_decode_write_keeps_the_decode_kernels_occupancy(compiled):
    """Writing the new token costs no programs per SM (a tile patched with the new row once held twice the registers)."""
    residency = {row["case"]: row["residency"] for row in compiled}
    assert residency["decode+write split llama3"] == residency["decode in-kernel merge llama3"] == 4


def test_the_gqa_packed_prefill_program_keeps_two_per_sm(compiled):
    """The wide launch's premise (two 8-warp programs share an SM) holds for the packed rows too."""
    residency = {row["case"]: row["residency"] for row in compiled}
    assert residency["split prefill wide gqa-packed llama3"] == residency["split prefill wide llama3"] == 2


def test_the_gluon_prefill_fits_one_program_per_sm_without_spills(compiled):
    """Two Q buffers and a 2-stage K/V ring in shared memory, no local memory: the schedule its docstring claims."""
    rows = [row for row in compiled if row["kernel"] == "_gluon_prefill_kernel"]
    assert len(rows) == 3
    for row in rows:
        assert row["wgmma"] > 0 and row["stack_bytes"] == 0
        assert row["shared_bytes"] <= 227 * 1024


def test_the_unified_kernels_split_variant_keeps_its_registers(compiled):
    """The split-KV variant (a short chunk on a long prefix) merges in a loop, not unrolled per split: no local
    memory at head_dim 128 and the unsplit launch's residency (an unrolled 16-way merge spilled 18 KB). Head
    dims that are not a power of 2 compile too (they run unsplit; the merge once broke their build)."""
    rows = {row["case"]: row for row in compiled if row["kernel"] == "_unified_kernel"}
    assert {"unified d80 group 7", "unified split-kv qwen3", "unified split-kv d256"} <= set(rows)
    assert rows["unified split-kv qwen3"]["stack_bytes"] == 0
    assert rows["unified split-kv qwen3"]["residency"] == rows["unified m64 llama3"]["residency"]
