"""The step loop and the disk tier's queued writes: a spill never waits for a host block's disk write while another
host block can be taken; when every one is still being written, the wait is counted in the stats."""

import threading
import time

import pytest
import torch

from helpers import tiny
from pagedkv import LLM, SamplingParams
from pagedkv.engine import startup
from pagedkv.engine.kv_disk import DiskStore

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
#: 18 prompt tokens + 4 generated: each prompt leaves 5 full blocks cached, which the next prompt spills (the GPU
#: pool of 9 blocks holds one request). A host tier of 10 blocks holds two prompts' spills.
PROMPT_TOKENS, NUM_HOST_BLOCKS = 18, 10


class _OpensGateOnWait:
    """A queued write's done event as the runner sees it: waiting on it first lets the held write go (so a step
    that waits for a held write never hangs the test, it only shows in the stats and in `gate`)."""

    def __init__(self, done: threading.Event, gate: threading.Event):
        self._done, self._gate = done, gate

    def is_set(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        self._gate.set()
        return self._done.wait(timeout)


class _HeldWrites(DiskStore):
    """A disk store whose writes queued while `holding` is on wait on `gate` (a slow disk's backlog). They wait on a
    writer thread of their own, so that the other writes (on the other thread) go on."""

    def __init__(self, *args, **kwargs):
        self.holding = True
        self.gate = threading.Event()
        self.held: list[bytes] = []  # keys of the held writes
        self.free: list[bytes] = []  # keys of the others
        super().__init__(*args, num_write_threads=2, **kwargs)

    def _jobs(self, key):
        return self._queues[0 if key in self.held else 1]  # the same thread for every job of a key, as in DiskStore

    def write_async(self, key, data, ready=None):
        if not self.holding:
            self.free.append(key)
            return super().write_async(key, data, ready)
        self.held.append(key)

        def ready_then_held():
            if ready is not None:
                ready()
            self.gate.wait()

        return _OpensGateOnWait(super().write_async(key, data, ready_then_held), self.gate)

    def wait_for_free_writes(self, timeout_s: float = 30.0) -> None:
        """Return once every write not held is done (the next step's poll tells the tiers)."""
        deadline = time.monotonic() + timeout_s
        while set(self._queued) - set(self.held):
            assert time.monotonic() < deadline, "the disk writer threads did not finish"
            time.sleep(0.002)


@pytest.fixture
def held_llm(monkeypatch, tmp_path):
    stores = []

    def store(*args, **kwargs):
        stores.append(_HeldWrites(*args, **kwargs))
        return stores[-1]

    monkeypatch.setattr(startup, "DiskStore", store)
    model = tiny("tiny-llama")
    probe = dict(hf_model=model, block_size=BLOCK, num_blocks=9, watermark=0.0)
    bytes_per_block = LLM(**probe, enable_prefix_caching=False).engine.pool.bytes_per_block
    llm = LLM(**probe, kv_offload_memory=NUM_HOST_BLOCKS * bytes_per_block, kv_offload_dir=str(tmp_path))
    assert llm.engine.runner.offload.num_host_blocks == NUM_HOST_BLOCKS
    yield llm, stores[0], probe
    stores[0].gate.set()
    llm.shutdown()


def _prompts(n):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(n)]


def _tokens(llm, prompts):
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_a_spill_takes_a_written_host_block_over_one_still_being_written(held_llm):
    llm, store, probe = held_llm
    prompts = _prompts(4)
    expected = _tokens(LLM(**probe, enable_prefix_caching=False), prompts)
    host = llm.engine.scheduler.block_manager.tiers.host
    got = _tokens(llm, prompts[:2])  # the second prompt spills the first's blocks: their writes are held
    store.holding = False
    got += _tokens(llm, prompts[2:3])  # spills the second's blocks into the last free host blocks
    store.wait_for_free_writes()
    assert host.allocator.num_free == 0 and len(store.held) == len(store.free) == NUM_HOST_BLOCKS // 2
    # The host is full: the least recently used blocks are still being written, the others are on disk.
    written, before = list(store.free), llm.stats()
    got += _tokens(llm, prompts[3:])  # spills some of the third prompt's blocks over written ones, without waiting
    stats = llm.stats()
    assert not store.gate.is_set() and stats["kv_disk_write_waits"] == 0
    num_spilled = stats["kv_offloaded_blocks"] - before["kv_offloaded_blocks"]
    assert num_spilled > 0 and sum(key not in host for key in written) == num_spilled
    assert all(key in host for key in store.held)
    llm.engine.check_integrity()
    store.gate.set()
    assert got == expected
    assert _tokens(llm, prompts) == expected  # the held writes done: every prefix again, from wherever it is
    llm.engine.check_integrity()


def test_a_spill_waits_for_a_write_only_when_every_host_block_is_being_written(held_llm):
    llm, store, probe = held_llm
    prompts = _prompts(4)
    expected = _tokens(LLM(**probe, enable_prefix_caching=False), prompts)
    got = _tokens(llm, prompts)  # the fourth prompt spills the third's blocks over held ones: it must wait
    stats = llm.stats()
    assert store.gate.is_set() and stats["kv_disk_write_waits"] > 0 and stats["kv_disk_write_wait_seconds"] > 0
    assert got == expected
    llm.engine.check_integrity()
