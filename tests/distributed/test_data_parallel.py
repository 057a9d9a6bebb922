"""Data-parallel replicas on CPU: two engine processes behind the router give the single engine's tokens."""

import pytest
import torch

from helpers import needs_two_gpus
from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError, InvalidArgumentError


def _prompts(shared_len=24, count=6):
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 500, (shared_len,), generator=gen).tolist()
    return [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in range(3, 3 + count)]


def _two_replicas(**options) -> LLM:
    """Two CPU replicas of the tiny Qwen3 behind the router."""
    return LLM("random:tiny-qwen3", data_parallel_size=2, device="cpu", block_size=4, **options)


@pytest.mark.slow
def test_two_replicas_equal_one_engine_and_spread_the_load():
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = dict(device="cpu", block_size=4, num_blocks=256)
    single = [o.outputs[0].token_ids for o in LLM("random:tiny-qwen3", **options).generate(_prompts(), params)]
    llm = LLM("random:tiny-qwen3", data_parallel_size=2, **options)
    try:
        engine = llm.engine
        outputs = llm.generate(_prompts(), params)
        assert [o.outputs[0].token_ids for o in outputs] == single
        stats = llm.stats()
        assert stats["num_generated_tokens"] == 8 * len(single) and stats["num_used_blocks"] == 0
        assert [(h["alive"], h["device"]) for h in engine.health()] == [(True, "cpu"), (True, "cpu")]
        # A shared prefix goes where the router sent it first; distinct prompts spread by load.
        assert sum(engine.router.stats.num_per_replica) == len(single)
    finally:
        llm.engine.shutdown()


def test_data_parallel_refuses_a_loaded_model():
    from pagedkv.hf import random_model

    with pytest.raises(ConfigError, match="model name"):
        LLM(hf_model=random_model("tiny-llama"), device="cpu", data_parallel_size=2)


def test_unconsumed_adds_count_as_waiting_so_a_burst_spreads():
    """A burst routed between two replica steps must see its own earlier requests, not a stale zero load."""
    from pagedkv.distributed.replica_process import LOAD_FIELDS, ProcessReplica
    from pagedkv.distributed.router import Router, RouterConfig

    load = [0] * (2 * LOAD_FIELDS)
    views = [ProcessReplica(i, 4, load) for i in range(2)]
    router = Router(views, RouterConfig())
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):  # distinct prompts: no prefix to follow, so load decides
        decision = router.route(torch.randint(3, 500, (12,), generator=gen).tolist())
        views[decision.replica].sent += 1
    assert [v.sent for v in views] == [4, 4]
    # Replica 0 consumes two adds and publishes them as waiting: the count is unchanged, not doubled.
    load[0:LOAD_FIELDS] = [2, 0, 0, 1, 2]
    assert views[0].num_waiting == 4
    load[0:LOAD_FIELDS] = [0, 4, 0, 1, 4]  # all four admitted and running
    assert views[0].num_waiting == 0 and views[0].num_running == 4


@pytest.mark.slow
def test_a_burst_of_requests_while_replicas_stream_does_not_deadlock():
    """The parent sends a burst without reading while replicas stream outputs: neither side may block for good.

    Both pipe directions fill (requests one way, per-step outputs the other); a replica that sent
    from its main loop blocked there and never read the requests the parent was blocked sending.
    """
    import threading
    import time

    llm = _two_replicas(num_blocks=2048, max_num_seqs=64)
    engine = llm.engine
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (200,), generator=gen).tolist() for _ in range(800)]
    # Few tokens each: the outputs still fill their pipe within one pause (every running request streams
    # every step), and the run stays short.
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def add_all():  # in bursts with pauses, so replicas step and stream while nobody reads their outputs
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            if i % 50 == 49:
                time.sleep(0.2)

    try:
        assert engine.stream_outputs  # every running request's output, every step
        adder = threading.Thread(target=add_all, daemon=True)
        adder.start()
        adder.join(timeout=180)
        if adder.is_alive():  # deadlocked: free the parent's blocked send before failing
            for replica in engine.replicas:
                replica.process.kill()
            pytest.fail("adding 800 requests without reading outputs blocked: the pipes deadlocked")
        finished = set()
        while engine.has_unfinished_requests():
            finished |= {o.request_id for o in engine.step(timeout_s=1.0) if o.finished}
        assert len(finished) == len(prompts)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_adding_requests_never_waits_for_a_replica_that_is_not_reading():
    """A replica reads its pipe only between steps; the router's least-loaded choice is often the busy one.

    Replica 0 is stopped (SIGSTOP: it reads nothing, as in a long step) while ~900 KB of requests
    are added: the parent must queue them and return (its sender thread waits), the other replica must
    keep being fed, and once replica 0 resumes every request must finish. Writing from the caller's
    thread, as before, blocked in the first full pipe.
    """
    import os
    import signal
    import threading
    import time

    llm = _two_replicas(num_blocks=2048, max_num_seqs=64)
    engine = llm.engine
    gen = torch.Generator().manual_seed(4)
    # ~900 KB of pickled requests (ids >= 256 pickle as 3 bytes), ~450 KB for the stopped replica: twice
    # Linux's default socket buffer, so a direct write must block.
    prompts = [torch.randint(256, 500, (500,), generator=gen).tolist() for _ in range(600)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.stream_outputs = False
    stopped = engine.replicas[0].process
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        adder = threading.Thread(target=lambda: [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)],
                                 daemon=True)
        adder.start()
        adder.join(timeout=60)
        blocked = adder.is_alive()
        if not blocked:  # metrics never wait on the stopped replica; a fresh stats() gives up on it
            reader = threading.Thread(target=engine.latest_stats, daemon=True)
            reader.start()
            reader.join(timeout=30)
            assert not reader.is_alive(), "latest_stats() waited on a replica that was not reading"
            assert engine.stats(timeout_s=0.5).per_replica[0] is None
        os.kill(stopped.pid, signal.SIGCONT)
        if blocked:
            adder.join(timeout=60)
            pytest.fail("add_request blocked on a replica that was not reading its pipe")
        finished = set()
        while engine.has_unfinished_requests():
            finished |= {o.request_id for o in engine.step(timeout_s=1.0) if o.finished}
        assert len(finished) == len(prompts)
        assert min(engine.router.stats.num_per_replica) > 0
        for _ in range(200):  # a replica pushes its stats once more when it goes idle
            latest = engine.latest_stats()
            if latest.num_used_blocks == 0 and latest.num_generated_tokens == len(prompts):
                break
            time.sleep(0.05)
        assert latest.num_used_blocks == 0 and latest.num_generated_tokens == len(prompts)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        engine.shutdown()


@pytest.mark.slow
def test_a_request_that_cannot_be_pickled_is_refused_and_the_replica_keeps_serving():
    """Commands are pickled in the caller's thread: an unpicklable one raises there, nothing is queued."""
    class LocalId(str):  # a local class: pickle cannot find it by name
        pass

    llm = _two_replicas(num_blocks=256)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        with pytest.raises(InvalidArgumentError, match="cannot be sent to a replica"):
            engine.add_request(LocalId("bad"), [5, 6, 7], params)
        assert not engine.has_unfinished_requests() and engine.router.stats.num_routed == 0
        outputs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
        assert all(r.writer.is_alive() for r in engine.replicas)
        assert all(s is not None for s in engine.stats().per_replica)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_server_metrics_follow_the_replicas_pushed_stats():
    """The server's per-step metrics read `latest_stats()` (no round trip to busy replicas) and still add up."""
    import time

    from pagedkv.server.metrics import ServerMetrics

    llm = _two_replicas(num_blocks=256)
    engine = llm.engine
    metrics = ServerMetrics()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        metrics.update_from_engine(engine)  # the baseline
        llm.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]], params)
        for _ in range(200):  # each replica pushes once more on going idle
            metrics.update_from_engine(engine)
            text = metrics.render().decode()
            if "pagedkv_generation_tokens_total 16.0" in text:
                break
            time.sleep(0.05)
        assert "pagedkv_generation_tokens_total 16.0" in text
        assert 'pagedkv_replica_alive{replica="0"} 1.0' in text and 'pagedkv_replica_alive{replica="1"} 1.0' in text
        assert "pagedkv_kv_cache_used_blocks 0.0" in text
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_replicas_of_tensor_parallel_groups_equal_one_engine():
    """DP=2 x TP=2 on CPU (gloo): each replica leads its own two-rank group; the tokens are one engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = dict(device="cpu", block_size=4, num_blocks=128)
    single = [o.outputs[0].token_ids for o in LLM("random:tiny-llama", **options).generate(_prompts(), params)]
    llm = LLM("random:tiny-llama", data_parallel_size=2, tensor_parallel_size=2, **options)
    try:
        outputs = llm.generate(_prompts(), params)
        assert [o.outputs[0].token_ids for o in outputs] == single
        assert [h["alive"] for h in llm.engine.health()] == [True, True]
        assert llm.stats()["num_used_blocks"] == 0
    finally:
        llm.engine.shutdown()
    assert not any(r.process.is_alive() for r in llm.engine.replicas)


def test_replica_devices_give_each_tensor_parallel_group_its_own_gpus(monkeypatch):
    from pagedkv.engine.config import EngineConfig
    from pagedkv.distributed.data_parallel import DataParallelEngine

    class FakeCuda:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def device_count():
            return 4

    fake_torch = type("FakeTorch", (), {"cuda": FakeCuda})
    config = EngineConfig(model="random:tiny-llama", tensor_parallel_size=2)
    assert DataParallelEngine._devices(config, 2, fake_torch) == ["cuda:0", "cuda:2"]
    with pytest.raises(ConfigError, match="needs 6 GPUs, but torch sees 4"):
        DataParallelEngine._devices(config, 3, fake_torch)


# --------------------------------------------------------------------------- on two CUDA GPUs
# Data-parallel replicas on two GPUs: each replica on its own device, fp32 greedy tokens equal one engine's.
@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("name, impl", [("tiny-llama", "pagedkv"), ("tiny-gpt2", "hf")])  # own decoder; HF's modules
def test_two_replicas_on_two_gpus_equal_one_engine_fp32(name, impl):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 9, 30, 64, 5, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16, model_impl=impl)
    single = [o.outputs[0].token_ids for o in LLM(f"random:{name}", **options).generate(prompts, params)]
    llm = LLM(f"random:{name}", data_parallel_size=2, **options)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == single
        health = llm.engine.health()
        assert [(h["alive"], h["device"]) for h in health] == [(True, "cuda:0"), (True, "cuda:1")]
        assert all(n > 0 for n in llm.engine.router.stats.num_per_replica)  # distinct prompts: spread by load
        assert llm.stats()["num_used_blocks"] == 0
    finally:
        llm.engine.shutdown()


def _die_before_ready(config):
    """An engine factory whose replica process dies abruptly, before it can report anything."""
    import os

    os._exit(3)


@pytest.mark.timeout(120)
def test_a_replica_that_dies_before_it_is_ready_fails_startup_instead_of_hanging():
    # One replica, as a Ray Serve replica's engine process: the parent's copy of the child's pipe end must be
    # closed, or the parent's read never sees the child go.
    from pagedkv.distributed.data_parallel import DataParallelEngine
    from pagedkv.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=r"replica 0 failed to start: its process exited \(code 3\)"):
        DataParallelEngine(EngineConfig(model="random:tiny-qwen3", device="cpu"), 1, engine_factory=_die_before_ready)


def test_a_replica_forwarding_its_deltas_gives_the_same_tokens_without_prompt_ids():
    """`decode_outputs=False` (a Ray Serve replica): step() hands the engine process's deltas on as they came."""
    from pagedkv.distributed.data_parallel import DataParallelEngine
    from pagedkv.distributed.output_deltas import DeltaDecoder, OutputDelta
    from pagedkv.engine.config import EngineConfig

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = _prompts(count=3)
    single = [o.outputs[0].token_ids for o in LLM("random:tiny-qwen3", device="cpu", block_size=4,
                                                    num_blocks=128).generate(prompts, params)]
    engine = DataParallelEngine(EngineConfig(model="random:tiny-qwen3", device="cpu", block_size=4, num_blocks=128),
                                1, decode_outputs=False)
    try:
        for k, prompt in enumerate(prompts):
            engine.add_request(f"r{k}", prompt, params)
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step(timeout_s=1.0)
        assert deltas and all(isinstance(d, OutputDelta) and d.prompt_token_ids is None for d in deltas)
        decoder, final = DeltaDecoder(), {}
        for delta in deltas:
            final[delta.request_id] = decoder.decode(delta, prompt_token_ids=prompts[int(delta.request_id[1:])])
        assert [final[f"r{k}"].outputs[0].token_ids for k in range(len(prompts))] == single
        assert final["r0"].prompt_token_ids == prompts[0] and all(o.finished for o in final.values())
        assert engine.stats().num_used_blocks == 0
    finally:
        engine.shutdown()
