"""Graphs for steps with prefill tokens: padded token buckets, padded sequence rows, padded LM-head rows.

Two modes: "piecewise" (attention eager on the real rows between graphs) and "full" (the unified
attention over the padded step, inside the one graph). On CPU nothing is captured:
`PiecewiseGraphs(capture=False)` runs the same padded layout eagerly, so what the graphs would
replay is checked here against plain eager steps. The GPU tests at the end capture and replay.
"""

import gc
import threading
import time
import weakref

import pytest
import torch
from helpers import tiny

from pagedkv import LLM, SamplingParams
from pagedkv.engine.piecewise_graphs import PiecewiseGraphs, no_collection_during_capture, token_buckets

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-gemma3"]  # tiny-gemma3: layer groups (sliding windows)
MODES = ["full", "piecewise"]


def test_token_buckets_cover_every_count_with_bounded_padding():
    for max_tokens in (1, 16, 17, 100, 2048, 5000):
        buckets = token_buckets(max_tokens)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
        for n in range(1, max_tokens + 1, 7):
            bucket = next(b for b in buckets if b >= n)
            # at most 15 padding tokens, or a quarter of the step beyond 128 tokens
            assert bucket - n <= max(15, n // 4 + 1), (max_tokens, n, bucket)


def _mixed_workload(vocab: int):
    """Prompts of mixed lengths (chunked under a small step budget) arriving while others decode."""
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 40, 17, 90, 1, 64, 33, 120]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=9, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, greedy, seeded


def _emulated(llm: LLM, mode: str) -> list[int]:
    """Swap the runner's eager mixed steps for the emulated layout of `mode`; returns each step's padding."""
    runner = llm.engine.runner
    runner.capture_attention = mode == "full"
    runner.piecewise = runner._piecewise(capture=False)
    used = []
    run = runner.piecewise.run

    def recording_run(num_tokens, meta):
        used.append(runner.piecewise.bucket_for(num_tokens) - num_tokens)
        return run(num_tokens, meta)

    runner.piecewise.run = recording_run
    return used


@pytest.mark.parametrize("name, mode", [("tiny-llama", "full"), ("tiny-qwen3", "full"), ("tiny-qwen3", "piecewise"),
                                        ("tiny-gemma3", "full"), ("tiny-gemma3", "piecewise")])
def test_padded_layout_equals_eager_steps(name, mode):
    model = tiny(name)
    options = dict(kv_cache_memory=8 * 2**20, max_num_batched_tokens=48, max_num_seqs=8)
    prompts, greedy, seeded = _mixed_workload(model.config.vocab_size)
    reference = LLM(hf_model=model, **options)
    want_greedy = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    want_seeded = [o.outputs[0].token_ids for o in reference.generate(prompts, seeded)]

    llm = LLM(hf_model=model, **options)
    padding = _emulated(llm, mode)
    got_greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    got_seeded = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
    assert got_greedy == want_greedy
    assert got_seeded == want_seeded
    # The layout was used, with padding: mixed steps whose token count is not a bucket.
    assert padding and any(p > 0 for p in padding)
    assert llm.stats()["num_used_blocks"] == 0
    llm.engine.scheduler.block_manager.check_integrity()


@pytest.mark.parametrize("mode", MODES)
def test_padding_rows_never_reach_the_pool_or_the_sampler(mode):
    """Padding tokens store K/V only to the scratch slot, and the LM head's padded rows are never sampled."""
    model = tiny("tiny-llama")
    llm = LLM(hf_model=model, kv_cache_memory=8 * 2**20, max_num_batched_tokens=48, max_num_seqs=8)
    _emulated(llm, mode)
    pool = llm.engine.pool
    scratch = llm.engine.runner.scratch_slot // pool.block_size
    before = [k.clone() for k in pool.k_caches]
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))  # a 3-token step in the 16 bucket
    for layer, k in enumerate(pool.k_caches):
        changed = set((k != before[layer]).flatten(1).any(dim=1).nonzero().flatten().tolist())
        # The prompt's one block, and at most the scratch block (where a fused store puts padding K/V).
        assert len(changed - {scratch}) == 1, (layer, changed)


def test_piecewise_graphs_are_not_built_without_cuda():
    llm = LLM(hf_model=tiny("tiny-llama"), kv_cache_memory=8 * 2**20)
    assert llm.engine.runner.piecewise is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_captured_graphs_equal_eager_steps_on_gpu(name, mode):
    """Captured and replayed: greedy and seeded outputs equal the eager engine's, fp32, on the GPU."""
    model = tiny(name).to("cuda")
    options = dict(kv_cache_memory=64 * 2**20, max_num_batched_tokens=48, max_num_seqs=8, dtype="float32")
    prompts, greedy, seeded = _mixed_workload(model.config.vocab_size)
    eager = LLM(hf_model=model, enforce_eager=True, **options)
    want = ([o.outputs[0].token_ids for o in eager.generate(prompts, greedy)],
            [o.outputs[0].token_ids for o in eager.generate(prompts, seeded)])
    del eager
    llm = LLM(hf_model=model, mixed_step_graphs=mode, **options)
    graphs = llm.engine.runner.piecewise
    assert isinstance(graphs, PiecewiseGraphs) and graphs.is_captured and graphs.capture_attention == (mode == "full")
    got = ([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)],
           [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)])
    assert got == want



class _EventWaiter(threading.Thread):
    """Records a CUDA event on a side stream and synchronizes on it, round after round, as another engine's KV disk
    writers do (`DiskStore` waits on the copy stream's event before it reads a host block); keeps what failed."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stream = torch.cuda.Stream()  # made here, before any capture begins
        self.rounds = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                done = torch.cuda.Event()
                done.record(self.stream)
                done.synchronize()
            except Exception as error:  # noqa: BLE001 - the test reports it
                self.errors.append(str(error)[:200])
            self.rounds += 1

    def wait_rounds(self, num_rounds: int, timeout_s: float = 10.0) -> None:
        """Return once this thread has made `num_rounds` more rounds of CUDA calls."""
        target, deadline = self.rounds + num_rounds, time.monotonic() + timeout_s
        while self.rounds < target:
            assert time.monotonic() < deadline, "the side thread made no CUDA calls"
            time.sleep(0.0005)


@pytest.mark.gpu
def test_graphs_capture_while_another_thread_waits_on_cuda_events(monkeypatch):
    """Another thread's CUDA calls during a capture (another engine's disk writers in the same process) leave the
    engine's captures alone: the decode and piecewise graphs capture, and replay the eager engine's tokens. Every
    capture is held open until the other thread has made two rounds of calls inside it; under a capture mode that
    checks every thread ("global"), those calls fail and the capture is invalidated."""
    model = tiny("tiny-qwen3").to("cuda")
    options = dict(kv_cache_memory=64 * 2**20, max_num_batched_tokens=48, max_num_seqs=8, dtype="float32")
    prompts, greedy, _ = _mixed_workload(model.config.vocab_size)
    want = [o.outputs[0].token_ids for o in LLM(hf_model=model, enforce_eager=True, **options).generate(prompts, greedy)]
    waiter = _EventWaiter()
    capture_end = torch.cuda.CUDAGraph.capture_end
    num_captures = []

    def capture_end_after_the_waiters_calls(graph):
        waiter.wait_rounds(2)
        num_captures.append(1)
        return capture_end(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", capture_end_after_the_waiters_calls)
    waiter.start()
    try:
        llm = LLM(hf_model=model, mixed_step_graphs="piecewise", **options)
    finally:
        waiter.stop.set()
        waiter.join()
    monkeypatch.undo()
    assert waiter.errors == []
    runner = llm.engine.runner
    assert runner.graphs and runner.piecewise.is_captured
    assert len(num_captures) > len(runner.graphs)  # the piecewise graphs' captures were held open too
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want


def test_no_collection_during_capture_collects_first_and_restores_the_collector():
    """Garbage left in cycles is collected before a capture, never inside it; the collector's state comes back,
    an exception included, and a collector that was off stays off."""
    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the collector frees it
    freed = weakref.ref(node)
    del node
    assert gc.isenabled()
    with no_collection_during_capture():
        assert freed() is None  # collected on the way in
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection_during_capture():
        raise RuntimeError("a capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection_during_capture():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_captures_keep_the_collector_off_until_the_last_ends():
    """Two captures on two threads (two engines in one process): the first to end must not turn the collector
    back on while the other still captures."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def second():
        first_in.wait()
        with no_collection_during_capture():
            second_in.set()
            first_out.wait()
            seen.append(gc.isenabled())

    thread = threading.Thread(target=second)
    thread.start()
    with no_collection_during_capture():
        first_in.set()
        second_in.wait()
    first_out.set()
    thread.join()
    assert seen == [False] and gc.isenabled()
