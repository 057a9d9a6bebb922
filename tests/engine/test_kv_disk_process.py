"""The disk tier's writer process (`kv_offload_disk_writer="process"`): the same files and tokens as the writer
threads, in order, after each block's copy, and the host pool in shared memory freed at shutdown."""

import logging
import os

import numpy as np
import pytest
import torch
from test_engine_kv_tiers import GREEDY, _chat_prompts, _disk_llm, _hittable_blocks, _llm, _one_by_one, _tokens

from pagedkv.engine.kv_disk_process import ProcessDiskStore, SharedHostPool
from pagedkv.errors import ConfigError

BLOCK_BYTES = 4096


class FakeEvent:
    """A CUDA event stand-in: not done until `done` is set (or `synchronize` waits it out)."""

    def __init__(self):
        self.done = False
        self.synchronized = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized += 1
        self.done = True


@pytest.fixture
def store(tmp_path):
    pool, why = SharedHostPool.create(8 * BLOCK_BYTES, pin=False)
    assert why is None
    store = ProcessDiskStore(tmp_path, "ab" * 32, BLOCK_BYTES, pool)
    yield store, pool.tensor.numpy().reshape(8, BLOCK_BYTES)
    store.close()
    name = pool.shm.name
    pool.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def _key(index: int) -> bytes:
    return bytes([index]) * 32


def test_the_process_writes_what_the_shared_pool_holds_and_reads_find_it(store):
    store, blocks = store
    for index in range(4):
        blocks[index] = index + 1
    dones = [store.write_async(_key(i), None, None, block=i) for i in range(4)]
    store.flush()
    assert all(done.is_set() for done in dones)
    assert sorted(store.poll()) == [(_key(i), True) for i in range(4)]
    out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    assert store.load(_key(2), out) and (out == 3).all()
    assert store._process.poll() is None  # alive until close


def test_a_write_waits_for_its_copy_and_a_delete_never_overtakes_it(store):
    store, blocks = store
    blocks[0] = 7
    event = FakeEvent()
    done = store.write_async(_key(0), None, event, block=0)
    store.delete_async(_key(0))  # queued behind the write: the file must end up gone
    store.delete_async(_key(5))
    store.poll()
    assert store._pending and not done.is_set()  # the copy is not done: nothing was sent
    event.done = True
    store.flush()
    assert done.is_set() and event.synchronized == 0 and not store._pending
    assert not store.path(_key(0)).exists()


def test_waiting_for_a_write_waits_out_its_copy(store):
    store, blocks = store
    blocks[1] = 9
    event = FakeEvent()
    done = store.write_async(_key(1), None, event, block=1)
    done.wait()
    assert done.is_set() and event.synchronized == 1
    out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    assert store.load(_key(1), out) and (out == 9).all()


def test_restart_through_the_writer_process_serves_every_prompt_block_from_disk(tmp_path):
    prompts = _chat_prompts(num_heads=2, per_head=2)
    expected = _tokens(_llm(enable_prefix_caching=False).generate(prompts, GREEDY))
    first = _disk_llm(tmp_path, kv_offload_disk_writer="process")
    disk = first.engine.runner.offload.disk
    assert isinstance(disk, ProcessDiskStore)
    shm_name = disk._pool.shm.name
    assert _tokens(first.generate(prompts, GREEDY)) == expected
    first.engine.shutdown()
    assert disk._process is None and not os.path.exists(f"/dev/shm/{shm_name}")
    second = _disk_llm(tmp_path, kv_offload_disk_writer="process")
    assert _tokens(_one_by_one(second, prompts, GREEDY)) == expected
    stats = second.stats()
    assert stats["kv_disk_hit_blocks"] + stats["kv_gpu_hit_blocks"] == _hittable_blocks(prompts)
    assert stats["kv_disk_hit_blocks"] > 0 and stats["kv_disk_load_misses"] == 0
    second.engine.check_integrity()
    second.engine.shutdown()


def test_without_room_in_dev_shm_the_engine_keeps_the_writer_threads(tmp_path, caplog, monkeypatch):
    from pagedkv.engine import kv_disk_process

    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(kv_disk_process.os, "statvfs", lambda path: Tiny() if path == kv_disk_process.SHM_DIR
                        else real(path))
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        llm = _disk_llm(tmp_path, kv_offload_disk_writer="process")
    assert not isinstance(llm.engine.runner.offload.disk, ProcessDiskStore)
    assert any("writer threads, not a writer process" in r.getMessage() and "/dev/shm" in r.getMessage()
               for r in caplog.records)
    prompts = _chat_prompts(num_heads=2, per_head=1)
    assert _tokens(llm.generate(prompts, GREEDY)) == _tokens(_llm(enable_prefix_caching=False).generate(prompts,
                                                                                                         GREEDY))
    llm.engine.shutdown()


def test_an_unknown_disk_writer_is_refused():
    with pytest.raises(ConfigError, match="kv_offload_disk_writer"):
        _llm(kv_offload_memory=64 * 2**10, kv_offload_disk_writer="fork")


def test_the_shared_host_pool_is_a_torch_view_of_the_segment():
    pool, why = SharedHostPool.create(2 * BLOCK_BYTES, pin=False)
    assert why is None and pool.tensor.dtype == torch.uint8 and pool.tensor.numel() == 2 * BLOCK_BYTES
    pool.tensor[:4] = 5
    assert bytes(pool.shm.buf[:4]) == b"\x05" * 4
    pool.close()
    pool.close()  # idempotent


def test_thousands_of_writes_queued_without_a_poll_do_not_fill_the_pipes(store):
    """Reports are read on a thread of their own: the writer never blocks on a full report pipe while the engine
    blocks on a full command pipe."""
    store, _ = store
    dones = [store.write_async(_key(i % 250) + bytes([i // 250]), None, None, block=i % 8) for i in range(5000)]
    store.flush()
    assert all(done.is_set() for done in dones) and len(store.poll()) == 5000


def test_a_writer_that_falls_behind_never_blocks_the_caller(store):
    """With the writer stopped, 2,000 writes (about 2.5 times what the command pipe holds) are queued at once: the
    sender thread, not the step loop, waits on the pipe; once the writer goes on, every one is written."""
    import signal
    import threading

    store, _ = store
    os.kill(store._process.pid, signal.SIGSTOP)
    dones: list = []
    try:
        queueing = threading.Thread(target=lambda: dones.extend(
            store.write_async(_key(i % 250) + bytes([i // 250]), None, None, block=i % 8) for i in range(2000)))
        queueing.start()
        # A bound against a hang, not a timing: blocked on the pipe it never returns. Generous, since a thread that
        # another test left spinning makes every lock hand-off here wait for the interpreter lock's switch interval.
        queueing.join(timeout=240)
        assert not queueing.is_alive() and len(dones) == 2000
        assert store.poll() == []  # nothing written yet: the writer is stopped
    finally:
        os.kill(store._process.pid, signal.SIGCONT)
    store.flush()
    assert all(done.is_set() for done in dones) and len(store.poll()) == 2000


def test_a_writer_process_that_dies_turns_the_disk_tier_off_and_nothing_hangs(store, caplog):
    store, _ = store
    first = store.write_async(_key(1), None, None, block=1)
    first.wait()
    store.poll()
    store._process.kill()
    store._process.wait()
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        later = [store.write_async(_key(i), None, None, block=i) for i in range(2, 6)]
        for done in later:
            done.wait()
        store.flush()
    reports = store.poll()
    assert sorted(reports) == [(_key(i), False) for i in range(2, 6)]
    assert store.disabled_reason is not None and "writer process" in store.disabled_reason
    assert any("KV disk tier off" in r.getMessage() for r in caplog.records)
    store.delete_async(_key(1))  # a no-op now, not an error


def test_the_writer_process_outlives_a_ctrl_c_meant_for_the_engine(store):
    import signal

    store, blocks = store
    store._process.send_signal(signal.SIGINT)
    blocks[0] = 4
    done = store.write_async(_key(0), None, None, block=0)
    done.wait()
    assert store.poll() == [(_key(0), True)] and store._process.poll() is None


def test_a_writer_process_that_cannot_start_leaves_the_writer_threads(tmp_path, caplog, monkeypatch):
    from pagedkv.engine import kv_disk_process

    monkeypatch.setattr(kv_disk_process.sys, "executable", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        llm = _disk_llm(tmp_path, kv_offload_disk_writer="process")
    assert not isinstance(llm.engine.runner.offload.disk, ProcessDiskStore)
    assert any("did not start" in r.getMessage() for r in caplog.records)
    llm.engine.shutdown()
