"""The disk tier's writes held while the step loop runs Python: a held write waits, every wait for one lets it go,
and the engine holds them exactly while it schedules, builds and launches (not while it waits for the device, and
not between steps)."""

import threading
import time

import numpy as np
import pytest
import torch

from helpers import tiny
from pagedkv import LLM, SamplingParams
from pagedkv.engine.kv_disk import DiskStore

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _store(tmp_path) -> DiskStore:
    return DiskStore(tmp_path, "ab" * 32, 64, num_write_threads=1)


def test_a_held_write_waits_until_released(tmp_path):
    store = _store(tmp_path)
    store.hold_writes()
    data = np.arange(64, dtype=np.uint8)
    done = store.write_async(b"k" * 32, data)
    assert not done.wait(0.2) and not store.path(b"k" * 32).exists() and store.writes_held
    store.release_writes()
    assert done.wait(10) and store.path(b"k" * 32).exists()
    store.close()


def test_a_write_whose_copies_end_during_a_hold_waits_for_its_release(tmp_path):
    """The writer took the job while the writes ran, then waited for its buffer's copies (`ready`, a CUDA
    event's synchronize); they end while the engine holds the writes: the write must wait for the release, not
    run beside the step loop's Python."""
    store = _store(tmp_path)
    copied, waiting = threading.Event(), threading.Event()

    def ready():
        waiting.set()
        copied.wait()

    done = store.write_async(b"k" * 32, np.arange(64, dtype=np.uint8), ready)
    assert waiting.wait(10)  # the writer took the job and waits in ready()
    store.hold_writes()
    copied.set()
    assert not done.wait(0.2) and not store.path(b"k" * 32).exists()
    store.release_writes()
    assert done.wait(10) and store.path(b"k" * 32).exists()
    store.close()


@pytest.mark.parametrize("wait", ["flush", "load", "close"])
def test_every_wait_for_a_held_write_releases_it(tmp_path, wait):
    store = _store(tmp_path)
    store.hold_writes()
    data = np.arange(64, dtype=np.uint8)
    store.write_async(b"k" * 32, data)
    finished = threading.Event()

    def waiter():
        if wait == "load":
            out = np.zeros(64, dtype=np.uint8)
            assert store.load(b"k" * 32, out) and (out == data).all()  # a queued write is no miss
        else:
            getattr(store, wait)()
        finished.set()

    threading.Thread(target=waiter, daemon=True).start()
    assert finished.wait(10), f"{wait} hung on a held write"
    assert store.path(b"k" * 32).exists()
    store.close()


class _Recorded:
    """A step result whose device read records whether the disk writes were held during it."""

    def __init__(self, result, disk, seen):
        self._result, self._disk, self._seen = result, disk, seen

    def token_ids(self):
        self._seen.append(("wait", self._disk.writes_held))
        return self._result.token_ids()

    def __getattr__(self, name):
        return getattr(self._result, name)


@pytest.mark.parametrize("during_steps", [False, True])
def test_the_engine_holds_disk_writes_while_it_runs_a_step_and_not_while_it_waits(tmp_path, during_steps):
    model = tiny("tiny-llama")
    common = dict(hf_model=model, block_size=4, num_blocks=9, watermark=0.0)
    bytes_per_block = LLM(**common, enable_prefix_caching=False).engine.pool.bytes_per_block
    llm = LLM(**common, kv_offload_memory=10 * bytes_per_block, kv_offload_dir=str(tmp_path),
              kv_offload_disk_writes_during_steps=during_steps)
    engine = llm.engine
    disk = engine.runner.offload.disk
    seen = []
    run_step, execute = engine._run_step, engine.runner.execute

    def recorded_step():
        seen.append(("step", disk.writes_held))
        return run_step()

    def recorded_execute(*args, **kwargs):
        result = execute(*args, **kwargs)
        seen.append(("launch", disk.writes_held))
        return _Recorded(result, disk, seen) if result is not None else None

    engine._run_step, engine.runner.execute = recorded_step, recorded_execute
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (18,), generator=gen).tolist() for _ in range(3)]
    with_tiers = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert not disk.writes_held  # between steps they run
    assert {kind for kind, _ in seen} == {"step", "launch", "wait"}
    assert all(held == (not during_steps and kind != "wait") for kind, held in seen), seen
    deadline = time.monotonic() + 10
    while not llm.stats()["kv_disk_written_blocks"] and time.monotonic() < deadline:
        llm.generate([prompts[0]], GREEDY)  # a step's poll tells the tiers what was written
    assert llm.stats()["kv_disk_written_blocks"] > 0  # the writes were held, never lost
    llm.shutdown()
    plain = LLM(**common)
    assert with_tiers == [plain.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_a_wait_lets_held_writes_run_and_the_hold_resumes_after_it(tmp_path):
    store = _store(tmp_path)
    store.hold_writes()
    data = np.arange(64, dtype=np.uint8)
    store.write_async(b"a" * 32, data)
    out = np.zeros(64, dtype=np.uint8)
    assert store.load(b"a" * 32, out)  # waited for the held write, which ran meanwhile
    assert store.writes_held  # the engine's hold stands
    done = store.write_async(b"b" * 32, data)
    assert not done.wait(0.2), "a write started while the engine held them, after another wait ended"
    store.release_writes()
    assert done.wait(10)
    store.close()


def _disk_io(tmp_path, num_blocks=2):
    from pagedkv.engine.kv_disk_io import DiskIO
    from pagedkv.engine.kv_offload import OffloadStats

    host = np.zeros((num_blocks, 64), dtype=np.uint8)
    return DiskIO(_store(tmp_path), host, OffloadStats()), host


def _finishes(call, timeout_s=10.0) -> bool:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def test_a_spill_that_waits_for_a_held_write_lets_it_run(tmp_path):
    io, host = _disk_io(tmp_path)
    io.disk.hold_writes()
    host[0] = 7
    io.write([(b"k" * 32, 0)], None)
    assert _finishes(lambda: io.wait_writes([0])), "wait_writes hung on a write the engine held"
    assert io.stats.disk_write_waits == 1 and io.disk.writes_held
    io.close()


def test_a_step_that_waits_for_its_disk_reads_lets_the_writes_they_wait_for_run(tmp_path):
    io, host = _disk_io(tmp_path)
    host[0] = 9
    io.write([(b"k" * 32, 0)], None)
    io.disk.flush()  # on disk
    io.disk.hold_writes()
    io.write([(b"j" * 32, 1)], None)  # held: a read into host block 1 must wait for it
    io.load([(b"k" * 32, 1)], None)
    assert _finishes(lambda: io.finish_loads(wait=True)), "finish_loads hung on a read behind a held write"
    loads, _, _ = io.poll()
    assert loads == [(b"k" * 32, True)] and (host[1] == 9).all()
    io.close()


@pytest.mark.parametrize("hold", [True, False])
def test_a_tensor_parallel_rank_holds_its_disk_writes_while_it_executes_a_step(tmp_path, hold):
    from types import SimpleNamespace

    from pagedkv.distributed.executor import serve_steps

    io, _ = _disk_io(tmp_path)
    steps = iter(["step 1", "step 2", None])
    seen = []

    def execute(step_input, previous_tokens):
        seen.append(io.disk.writes_held)
        return SimpleNamespace(device_tokens=step_input)

    serve_steps(SimpleNamespace(broadcast_object=lambda: next(steps)),
                SimpleNamespace(offload=SimpleNamespace(io=io), execute=execute), hold_disk_writes=hold)
    assert seen == [hold, hold] and not io.disk.writes_held  # free while it waits for the next step
    io.close()
