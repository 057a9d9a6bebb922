"""`KVOffload.move`: the order of a step's copies keeps every block valid.

On CUDA the step's kernels wait only for the on-device gather of the blocks it spills; their copies to the host run
later on a stream of their own. So a restore in the same step reads the spilled blocks from the gathered tensor, and
a restore in a later step waits for the copy that fills its host block. On the CPU every copy runs in order; the
tests run there too, and on a GPU under `-m gpu`.
"""

import time
from types import SimpleNamespace

import pytest
import torch

from pagedkv.core.block_table import BlockCopy
from pagedkv.engine.kv_disk import DiskStore
from pagedkv.engine.kv_offload import KVOffload, _source_runs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


#: GPU cycles the out stream sleeps before each batch's copies to the host (~0.25 s on an H200), so that a copy
#: that should wait for them and does not reads or writes its host block first, every time.
OUT_STREAM_SLEEP_CYCLES = 500_000_000


@pytest.fixture(autouse=True)
def slow_copies_out(monkeypatch):
    """On CUDA every batch of copies to the host waits behind a sleep on the out stream."""
    hold_back = KVOffload._hold_back_copies_out

    def slow(self, nbytes):  # runs just before each batch's gather
        with torch.cuda.stream(self.out_stream):
            torch.cuda._sleep(OUT_STREAM_SLEEP_CYCLES)
        hold_back(self, nbytes)

    monkeypatch.setattr(KVOffload, "_hold_back_copies_out", slow)


def _step(**copies):
    fields = ("persist", "persist_host", "persist_order", "disk_loads", "swap_out", "offload", "swap_in",
              "restore_in_step", "restore", "pre_offload", "disk_writes", "disk_deletes")
    return SimpleNamespace(**{name: copies.get(name, []) for name in fields})


def _offload(device, num_blocks=8, num_host_blocks=4, block_tokens=4, disk_dir=None):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    storage = torch.randn((2, 3, num_blocks, block_tokens, 2, 16), device=device)  # [2, L, N, B, Hkv, D]
    disk = None if disk_dir is None else DiskStore(disk_dir, "ab" * 32, storage[:, :, 0].numel() * 4)
    offload = KVOffload(SimpleNamespace(device=storage.device, kv_storage=storage), num_host_blocks, disk=disk)
    offload.host.zero_()
    return storage, offload


def test_source_runs_split_host_blocks_by_where_they_come_from():
    # host blocks 3, 4 and 7 are filled by this step's spills, at rows 0, 1 and 2 of the gathered blocks
    assert _source_runs([1, 2, 3, 4, 5, 7, 9], {3: 0, 4: 1, 7: 2}) == [
        (0, 1, 2, False), (2, 0, 2, True), (4, 5, 1, False), (5, 2, 1, True), (6, 9, 1, False)]
    assert _source_runs([3, 4], {}) == [(0, 3, 2, False)]
    assert _source_runs([4, 3], {3: 0, 4: 1}) == [(0, 1, 1, True), (1, 0, 1, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["restore_in_step", "restore"])
def test_a_block_spilled_and_restored_in_one_step_comes_back_whole(device, where):
    storage, offload = _offload(device)
    spilled = storage[:, :, 2].clone()
    # GPU block 2 spills into host block 1; host block 1 is restored into GPU block 5; another pair rides along,
    # and host block 3 (not spilled in this step) is restored beside it.
    offload.host[3] = storage[:, :, 7].clone().to(offload.host.device)
    kept = storage[:, :, 7].clone()
    offload.move(_step(offload=[BlockCopy(2, 1), BlockCopy(3, 0)], **{where: [BlockCopy(1, 5), BlockCopy(3, 6)]}))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(storage[:, :, 5], spilled)
    assert torch.equal(storage[:, :, 6], kept)
    assert torch.equal(offload.host[1].to(device), spilled)
    offload.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["restore_in_step", "restore"])
@pytest.mark.parametrize("held_back", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_a_restore_in_the_next_step_reads_the_spill_whole(device, where, held_back, staged, monkeypatch):
    """Many blocks spill in two steps (long copies to the host), and the very next step, whose kernels may have
    started before those copies ran, restores two of them and overwrites the spilled GPU blocks; `held_back`:
    with no bytes allowed in flight, so the second gather waits for the first step's copies (and lets go of
    them: a restore staged at admission, on a stream of its own, must still wait for them); `staged`: the
    restore's copies start at admission (`stage_restore`)."""
    if held_back:
        monkeypatch.setattr(KVOffload, "MAX_BYTES_COPYING_OUT", 0)
    storage, offload = _offload(device, num_blocks=66, num_host_blocks=64, block_tokens=256)
    spilled = storage[:, :, :64].clone()
    offload.move(_step(offload=[BlockCopy(block, 63 - block) for block in range(32)]))
    offload.move(_step(offload=[BlockCopy(block, 63 - block) for block in range(32, 64)]))
    if device == "cuda":
        time.sleep(0.05)  # the gathers are long done; the copies out sleep behind OUT_STREAM_SLEEP_CYCLES
        # held back, the second gather (on the copy stream) waits for the first batch's copies out
        assert offload.stream.query() is not held_back
    storage[:, :, :64] = -1.0  # the step's kernels reuse the spilled blocks (on the main stream, as they would)
    if staged:
        offload.stage_restore([0, 63])
    offload.move(_step(**{where: [BlockCopy(0, 64), BlockCopy(63, 65)]}))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(storage[:, :, 64], spilled[:, :, 63])
    assert torch.equal(storage[:, :, 65], spilled[:, :, 0])
    assert torch.equal(offload.host.to(device).movedim(0, 2).flip(2), spilled)
    offload.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_spill_into_a_host_block_still_being_filled_by_an_earlier_copy_out_lands_last(device):
    """A batch goes out; the next step spills a single block into one of the same host blocks (freed and taken
    again): the later spill's bytes must be the ones that stay."""
    storage, offload = _offload(device, num_blocks=16, num_host_blocks=8, block_tokens=256)
    offload.move(_step(offload=[BlockCopy(block, block) for block in range(8)]))
    offload.move(_step(offload=[BlockCopy(9, 3)]))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(offload.host[3].to(device), storage[:, :, 9])
    assert torch.equal(offload.host[4].to(device), storage[:, :, 4])
    offload.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_spill_in_the_step_after_a_restore_leaves_the_restored_block_whole(device):
    """A restore beside a step reads a host block; the next step spills into that same host block (freed and
    taken again): the restore must have read the block before the spill overwrote it."""
    storage, offload = _offload(device, num_blocks=8, num_host_blocks=2, block_tokens=256)
    old = storage[:, :, 1].clone()
    offload.move(_step(offload=[BlockCopy(1, 0)]))
    offload.move(_step(restore=[BlockCopy(0, 4)]))
    offload.move(_step(offload=[BlockCopy(2, 0)]))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(storage[:, :, 4], old)
    assert torch.equal(offload.host[0].to(device), storage[:, :, 2])
    offload.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_disk_write_of_a_spilled_block_reads_it_after_its_copy_to_the_host(device, tmp_path):
    """A spill and its block's disk write in one step: the writer thread must wait for the copy to the host (on
    CUDA behind its sleep on the out stream), or the file holds the host block's old bytes (zeros)."""
    storage, offload = _offload(device, num_blocks=8, num_host_blocks=4, block_tokens=256, disk_dir=tmp_path)
    key = b"k" * 32
    offload.move(_step(offload=[BlockCopy(2, 1), BlockCopy(5, 3)], disk_writes=[(key, 1)]))
    offload.disk.flush()
    out = torch.empty_like(storage[:, :, 2], device="cpu")
    assert offload.disk.load(key, out.view(torch.uint8).numpy())
    assert torch.equal(out, storage[:, :, 2].cpu())
    offload.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["restore_in_step", "restore"])
def test_a_restore_staged_at_admission_holds_up_only_the_requests_that_need_it(device, where):
    """A restore staged at admission (`stage_restore`) whose copies are slow (on CUDA behind a sleep on the stage
    stream), then the step that spills another block and claims the restore: its gather and, for a restore beside
    the step, the main stream go on without waiting for the staged copies; a restore in the step holds the main
    stream (its kernels read the blocks); either way the scatter waits for them, so the blocks come back whole."""
    storage, offload = _offload(device, num_blocks=8, num_host_blocks=4, block_tokens=256)
    restored = torch.randn_like(offload.host[0])
    offload.host[0] = restored
    spilled = storage[:, :, 2].clone()
    if device == "cuda":
        torch.cuda.synchronize()
        with torch.cuda.stream(offload.stage_stream):
            torch.cuda._sleep(OUT_STREAM_SLEEP_CYCLES)
    offload.stage_restore([0])
    offload.move(_step(offload=[BlockCopy(2, 1)], **{where: [BlockCopy(0, 5)]}))
    if device == "cuda":
        main_done = torch.cuda.Event()
        main_done.record()
        main_done.synchronize()  # the main stream's work up to the step's kernels
        assert offload.stage_stream.query() is (where == "restore_in_step")
        torch.cuda.synchronize()
    assert torch.equal(storage[:, :, 5], restored.to(device))
    assert torch.equal(offload.host[1].to(device), spilled)
    assert not offload._early
    offload.close()
