"""Tensor parallelism on CPU: two processes over gloo give TP=1's greedy tokens; a dead worker fails cleanly."""

import os
import signal

import pytest
import torch

from helpers import needs_two_gpus
from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError, EngineDeadError

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (4, 19, 9, 33)]


def _llm(name, tp, **options):
    return LLM(f"random:{name}", device="cpu", block_size=4, num_blocks=256, max_num_batched_tokens=16,
               tensor_parallel_size=tp, **options)


@pytest.mark.slow
@pytest.mark.parametrize("name, kv_cache_dtype", [("tiny-llama", "auto"), ("tiny-qwen3", "auto"),
                                                  ("tiny-llama", "fp8_e4m3"), ("tiny-gemma2", "auto")])
def test_tp2_over_gloo_equals_tp1(name, kv_cache_dtype):
    """FP8: each rank calibrates the whole model and keeps its heads' scales, so its bytes are TP=1's."""
    single = [o.outputs[0].token_ids for o in _llm(name, 1, kv_cache_dtype=kv_cache_dtype).generate(_prompts(), PARAMS)]
    llm = _llm(name, 2, kv_cache_dtype=kv_cache_dtype)
    try:
        assert llm.engine.tp.size == 2 and llm.engine.model.local_cfg.num_kv_heads * 2 == llm.engine.model.cfg.num_kv_heads
        outputs = llm.generate(_prompts(), PARAMS)
        assert [o.outputs[0].token_ids for o in outputs] == single
        assert llm.stats()["num_used_blocks"] == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_tp2_sampling_equals_tp1():
    """Only rank 0 samples; the workers take its broadcast tokens as their next inputs (seeded, n=2, logprobs)."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.2, top_k=20, seed=6, n=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=9, ignore_eos=True, frequency_penalty=0.5)]

    def run(llm):
        outputs = llm.generate(_prompts(), params)
        return [[(c.token_ids, [e.token_id for e in c.logprobs or []]) for c in o.outputs] for o in outputs]

    single = run(_llm("tiny-llama", 1))
    llm = _llm("tiny-llama", 2)
    try:
        assert run(llm) == single
        assert llm.stats()["num_used_blocks"] == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_a_dead_worker_fails_requests_with_a_clear_error():
    llm = _llm("tiny-llama", 2)
    try:
        llm.generate(_prompts()[:1], PARAMS)
        llm.engine.executor.workers[0].kill()
        llm.engine.executor.workers[0].join(timeout=10)
        with pytest.raises(EngineDeadError, match="worker"):
            llm.generate(_prompts(), PARAMS)
        assert llm.stats()["num_used_blocks"] == 0 and not llm.engine.has_unfinished_requests()
        with pytest.raises(EngineDeadError):
            llm.engine.step()
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_a_stuck_worker_fails_the_engine_at_the_collective_timeout():
    """A worker that stops answering (SIGSTOP) makes a collective time out: requests fail, the engine stops."""
    llm = _llm("tiny-llama", 2, distributed_timeout_s=10)
    worker = llm.engine.executor.workers[0]
    try:
        llm.generate(_prompts()[:1], PARAMS)
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(EngineDeadError, match="tensor-parallel step failed"):
            llm.generate(_prompts(), PARAMS)
        assert llm.stats()["num_used_blocks"] == 0 and not llm.engine.has_unfinished_requests()
        with pytest.raises(EngineDeadError):
            llm.engine.step()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        llm.engine.shutdown()
    assert not worker.is_alive()


@pytest.mark.slow
def test_an_error_before_the_step_is_sent_leaves_the_engine_running(monkeypatch):
    """Only a failure after the broadcast desynchronizes the ranks; one in scheduling propagates as it is."""
    llm = _llm("tiny-llama", 2)
    try:
        engine = llm.engine
        schedule = engine.scheduler.schedule
        calls = []

        def failing_once():
            if not calls:
                calls.append(1)
                raise RuntimeError("scheduling failed")
            return schedule()

        monkeypatch.setattr(engine.scheduler, "schedule", failing_once)
        engine.add_request("r", _prompts()[0], PARAMS)
        with pytest.raises(RuntimeError, match="scheduling failed"):
            engine.step()
        assert engine._dead is None
        monkeypatch.setattr(engine.scheduler, "schedule", schedule)
        outputs = llm.generate(_prompts()[1:2], PARAMS)
        single = _llm("tiny-llama", 1).generate(_prompts()[1:2], PARAMS)
        assert outputs[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    finally:
        llm.engine.shutdown()


def test_heads_that_do_not_divide_are_refused_before_any_process_starts():
    # tiny-mistral has one KV head: it cannot be split two ways.
    with pytest.raises(ConfigError, match="num_key_value_heads = 1 does not divide"):
        from pagedkv.models import DecoderConfig
        from pagedkv.hf import random_model

        DecoderConfig.from_hf(random_model("tiny-mistral").config).shard(2)


def test_an_unknown_all_reduce_mode_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("PAGEDKV_TP_ALL_REDUCE", "ring")
    with pytest.raises(ConfigError, match="PAGEDKV_TP_ALL_REDUCE must be one of nccl, symm_mem, got 'ring'"):
        _llm("tiny-llama", 2)


def test_more_gpus_than_exist_is_refused():
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        with pytest.raises(ConfigError, match="GPUs"):
            LLM("random:tiny-llama", tensor_parallel_size=count + 1)
    with pytest.raises(ConfigError, match="model name"):
        from pagedkv.hf import random_model

        LLM(hf_model=random_model("tiny-llama"), device="cpu", tensor_parallel_size=2)


def test_a_worker_that_dies_before_joining_fails_the_startup_at_once():
    """Rank 0 waits for each worker's check-in while watching the processes, not for torch's whole timeout."""
    import time

    import torch.multiprocessing as mp

    from pagedkv.distributed.parallel import ParallelConfig, TensorParallel
    from pagedkv.distributed.executor import free_tcp_address

    worker = mp.get_context("spawn").Process(target=os._exit, args=(3,))
    worker.start()

    def alive():
        if not worker.is_alive():
            raise EngineDeadError(f"worker exited with code {worker.exitcode}")

    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="exited with code 3"):
        TensorParallel(ParallelConfig(2, 0, free_tcp_address(), "cpu", timeout_s=120), alive=alive)
    assert time.monotonic() - start < 60


def test_a_step_whose_collectives_never_finish_fails_at_the_deadline():
    """On CUDA a stuck peer leaves the step's event pending: the engine gives up after distributed_timeout_s,
    aborts the group and fails the requests (NCCL's watchdog, which would end the process, waits longer)."""
    from dataclasses import replace

    from pagedkv.distributed.executor import TensorParallelExecutor
    from pagedkv.engine.engine import _InFlight

    llm = LLM("random:tiny-llama", device="cpu", block_size=4, num_blocks=64)
    engine = llm.engine
    engine.add_request("r", [5, 6, 7], PARAMS)
    aborted = []

    class StuckGroup:  # stands in for a TensorParallel whose peer stopped answering
        def abort(self):
            aborted.append(True)

    class PendingResult:
        def ready(self):
            return False

    executor = TensorParallelExecutor.__new__(TensorParallelExecutor)  # rank 0's handle, on the stuck group
    executor.tp, executor.workers, executor.worker_exit = StuckGroup(), [], None
    engine.executor, engine.config = executor, replace(engine.config, distributed_timeout_s=0.2)
    with pytest.raises(EngineDeadError, match="did not finish within distributed_timeout_s = 0.2 s"):
        engine._complete(_InFlight(out=None, step_input=None, result=PendingResult(), length_finished=[]))
    assert aborted and not engine.has_unfinished_requests() and llm.stats()["num_used_blocks"] == 0
    with pytest.raises(EngineDeadError):
        engine.step()


_TORCHRUN_SCRIPT = """
import json, sys
from pagedkv import LLM, SamplingParams
prompts = json.loads(sys.argv[1])
llm = LLM("random:tiny-llama", device="cpu", block_size=4, num_blocks=256, max_num_batched_tokens=16,
          tensor_parallel_size=2)  # ranks > 0 serve rank 0's steps inside this call, then exit
params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
llm.engine.shutdown()
print("TOKENS " + json.dumps(tokens), flush=True)
"""


@pytest.mark.slow
def test_ranks_started_by_torchrun_equal_tp1(tmp_path):
    """`torchrun --nproc-per-node 2 script.py`: every process builds the LLM; rank 0 drives, rank 1 serves."""
    import json
    import subprocess
    import sys

    script = tmp_path / "tp_script.py"
    script.write_text(_TORCHRUN_SCRIPT)
    single = [o.outputs[0].token_ids for o in _llm("tiny-llama", 1).generate(_prompts(), PARAMS)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), json.dumps(_prompts())],
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1  # only rank 0 returns from LLM(...) with an engine to drive
    assert json.loads(lines[0][len("TOKENS "):]) == single


def test_each_rank_finds_its_device(monkeypatch):
    """Spawned groups count from their first GPU (a DP replica's); torchrun's LOCAL_RANK wins under env://."""
    from pagedkv.distributed.parallel import ParallelConfig

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert ParallelConfig(2, 1, "tcp://127.0.0.1:1", "cuda", first_device=2).local_device == 3
    assert ParallelConfig(2, 1, "env://", "cuda").local_device == 1
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert ParallelConfig(2, 1, "env://", "cuda").local_device == 5
    assert ParallelConfig(2, 1, "tcp://127.0.0.1:1", "cuda", first_device=2).local_device == 3  # not torchrun's


def test_the_one_shot_limit_covers_decode_steps_with_two_ranks():
    from pagedkv.distributed.parallel import symm_mem_bytes

    assert symm_mem_bytes(2) >= 256 * 4096 * 2  # a batch-256 decode step of Llama-3-8B, bf16
    assert symm_mem_bytes(8) < symm_mem_bytes(2)  # more peers to read: NCCL's ring sooner


# --------------------------------------------------------------------------- on two CUDA GPUs
# Tensor parallelism on two GPUs (NCCL, CUDA graphs): fp32 greedy tokens equal one GPU's and HF's.
@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("all_reduce", ["nccl", "symm_mem"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tp2_with_graphs_equals_tp1_fp32(name, all_reduce, monkeypatch):
    monkeypatch.setenv("PAGEDKV_TP_ALL_REDUCE", all_reduce)  # spawned workers inherit it
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 17, 64, 1, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16)
    single = [o.outputs[0].token_ids for o in LLM(f"random:{name}", **options).generate(prompts, params)]
    llm = LLM(f"random:{name}", tensor_parallel_size=2, **options)
    try:
        assert llm.engine.runner.graphs and llm.engine.tp.all_reduce_mode == all_reduce
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == single
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
@needs_two_gpus
def test_tp2_seeded_sampling_equals_tp1_fp32():
    """Rank 0 samples and broadcasts the tokens on the device; the workers' next inputs are those tokens."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 33, 12, 70)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=20, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=16, ignore_eos=True))
    options = dict(dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16)

    def tokens(llm):
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]

    single = tokens(LLM("random:tiny-llama", **options))
    llm = LLM("random:tiny-llama", tensor_parallel_size=2, **options)
    try:
        assert tokens(llm) == single
    finally:
        llm.engine.shutdown()
