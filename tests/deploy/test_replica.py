"""`EngineReplica` driven directly, without Ray: the calls Ray Serve makes, on one event loop.

A request's outputs reach its sender's `outputs` stream as deltas that decode to the engine's own
greedy tokens; a refused request ends with a failure message carrying its status; a caller that
goes away mid-request has the request aborted and its blocks freed.
"""

import asyncio
import time

import pytest

pytest.importorskip("ray")

from pagedkv.deploy.replica import OUTPUTS_IDLE_S, EngineReplica, pack_messages, unpack_messages  # noqa: E402
from pagedkv.distributed.output_deltas import DeltaDecoder  # noqa: E402
from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray

#: One event loop for every call, as a Serve replica has: an engine process's front lives on the loop of its first call.
LOOP = asyncio.new_event_loop()


def on_loop(coro):
    return LOOP.run_until_complete(coro)

OPTIONS = dict(model="random:tiny-llama", device="cpu", dtype="float32", block_size=4, num_blocks=64,
               max_model_len=64, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]


async def read_outputs(items, ids) -> tuple[dict, dict, list]:
    """Decode a replica's `(packed messages, load)` items (an `outputs` stream's or a lane's) until each of `ids`
    ended: (finished outputs, failures, the request id of every output message), by id."""
    decoder, done, failed, seen = DeltaDecoder(), {}, {}, []
    remaining = set(ids)
    async for blob, load in items:
        assert load.replica == "local"
        for message in unpack_messages(blob):
            if message[0] == "output":
                seen.append(message[1][0])
                output = decoder.decode(message[1])
                if output.finished:
                    done[output.request_id] = output
                    remaining.discard(output.request_id)
            else:
                failed[message[1]] = message[2:]
                remaining.discard(message[1])
        if not remaining:
            break
    return done, failed, seen


async def _serve(replica: EngineReplica, calls: list[tuple[str, list[int], SamplingParams]], sender: str = "s"):
    """Each call through `generate`, every message through `outputs`; (finished outputs, failures) by id."""
    ids = [request_id for request_id, _, _ in calls]
    reader = asyncio.create_task(read_outputs(replica.outputs(sender), ids))

    async def call(request_id, tokens, params):
        items = [item async for item in replica.generate(request_id, tokens, params, sender=sender)]
        assert items == ["local"]  # one item, the replica's id, then the call ends with its request

    await asyncio.gather(*(call(*c) for c in calls))
    done, failed, _ = await asyncio.wait_for(reader, timeout=60)
    return done, failed


@pytest.fixture(scope="module", params=["thread", "process", "loop"],
                ids=["engine-thread", "engine-process", "engine-process-on-loop"])
def replica(request):
    """Each placement: an engine thread's outputs are encoded by the replica, an engine process's deltas pass
    through it as they came, whether an engine thread or the replica's loop drives the process."""
    replica = EngineReplica(EngineConfig(**OPTIONS), engine_process=request.param != "thread",
                            engine_thread=request.param != "loop")
    yield replica
    replica.__del__()  # on the loop's thread: an engine process's front stops there at once


def test_outputs_reach_the_sender_and_equal_the_engine(replica):
    done, failed = on_loop(_serve(replica, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]))
    expected = LLM(**OPTIONS).generate(PROMPTS, GREEDY)
    assert not failed
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        e.outputs[0].token_ids for e in expected]
    assert on_loop(replica.check_integrity()) == 0


def test_samples_and_logprobs_reach_the_sender_as_the_engine_made_them(replica):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=2, logprobs=2)
    done, failed = on_loop(_serve(replica, [("n2", PROMPTS[1], params)]))
    (expected,) = LLM(**OPTIONS).generate([PROMPTS[1]], params)
    assert not failed and len(done["n2"].outputs) == 2
    for got, want in zip(done["n2"].outputs, expected.outputs):
        assert (got.index, got.token_ids, got.finish_reason) == (want.index, want.token_ids, want.finish_reason)
        assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in want.logprobs]
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert on_loop(replica.check_integrity()) == 0


def test_a_refused_request_ends_with_its_failure_and_status(replica):
    too_long = list(range(3, 3 + OPTIONS["max_model_len"] + 1))
    done, failed = on_loop(_serve(replica, [("ok", PROMPTS[0], GREEDY), ("bad", too_long, GREEDY)]))
    assert set(done) == {"ok"} and set(failed) == {"bad"}
    message, status = failed["bad"]
    assert status == 400 and str(OPTIONS["max_model_len"]) in message
    assert on_loop(replica.check_integrity()) == 0


def test_a_caller_that_goes_away_aborts_its_request_and_frees_its_blocks(replica):
    async def run():
        long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        reader = asyncio.create_task(replica.outputs("gone").__anext__())
        call = replica.generate("abandoned", PROMPTS[2], long, sender="gone")
        assert await call.__anext__() == "local"
        await reader  # the engine has produced at least one output for it
        await call.aclose()  # what Ray does when the ingress cancels the call
        for _ in range(200):  # the abort reaches the engine thread, which frees the blocks
            if await replica.check_integrity() == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert on_loop(run())


def test_messages_travel_in_pieces_under_the_limit_in_order():
    messages = [("output", f"{i:03d}" + "x" * 300, i) for i in range(40)]  # distinct texts (pickle memoizes)
    pieces = pack_messages(messages, limit=2000)
    assert len(pieces) > 1 and all(len(piece) <= 2000 for piece in pieces)
    assert [m for piece in pieces for m in unpack_messages(piece)] == messages
    assert len(pack_messages(messages)) == 1  # under the default limit: one item
    (alone,) = pack_messages([("output", "y" * 5000)], limit=2000)  # one message larger than the limit: unsplit
    assert unpack_messages(alone) == [("output", "y" * 5000)]


def test_a_second_output_stream_of_a_sender_takes_over_and_the_first_ends(replica):
    async def run():
        first = replica.outputs("twice")
        first_item = asyncio.create_task(first.__anext__())
        await asyncio.sleep(0)
        second = replica.outputs("twice")  # the ingress lost its first stream and opened another
        second_item = asyncio.create_task(second.__anext__())
        await asyncio.sleep(0.05)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(first_item, 10)  # the first reader ended; it took no message
        call = replica.generate("taken-over", PROMPTS[0], GREEDY, sender="twice")
        assert await call.__anext__() == "local"
        decoder, tokens = DeltaDecoder(), None
        blob, _ = await asyncio.wait_for(second_item, 30)
        while True:
            for message in unpack_messages(blob):
                output = decoder.decode(message[1])
                if output.finished:
                    tokens = output.outputs[0].token_ids
            if tokens is not None:
                break
            blob, _ = await asyncio.wait_for(second.__anext__(), 30)
        await call.aclose()
        await second.aclose()
        return tokens

    tokens = on_loop(run())
    assert tokens == LLM(**OPTIONS).generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    assert on_loop(replica.check_integrity()) == 0


def test_an_idle_output_stream_ends_and_a_busy_one_does_not(replica):
    async def run():
        replica.outputs_idle_s = 0.01  # shorter than a CPU step: only the request in flight keeps the stream open
        try:
            idle = replica.outputs("idle")
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(idle.__anext__(), 10)  # nothing sent here: it ends
            return await _serve(replica, [("busy", PROMPTS[1], GREEDY)], sender="busy")
        finally:
            replica.outputs_idle_s = OUTPUTS_IDLE_S

    done, failed = on_loop(run())
    assert not failed and len(done["busy"].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("end", ["finished", "aborted"])
def test_a_stream_read_without_pause_idles_out_once_its_last_request_ended(replica, end):
    # As Serve reads an `outputs` stream: the next item is asked for as soon as one went out, so the reader is
    # already waiting when the request's call ends; the call's end must wake it for the idle clock to start.
    async def run():
        replica.outputs_idle_s = 0.2
        seen = []

        async def read():
            async for blob, _ in replica.outputs(f"pull-{end}"):
                seen.extend(unpack_messages(blob))

        reader = asyncio.create_task(read())
        params = GREEDY if end == "finished" else SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        call = replica.generate(f"idle-{end}", PROMPTS[0], params, sender=f"pull-{end}")
        assert await call.__anext__() == "local"
        if end == "finished":
            with pytest.raises(StopAsyncIteration):
                await call.__anext__()
        else:
            while not seen:
                await asyncio.sleep(0.01)
            await call.aclose()  # the ingress cancelled it
        done, _ = await asyncio.wait({reader}, timeout=10)
        reader.cancel()
        return bool(done)

    try:
        assert on_loop(run()), "the stream stayed open after its last request ended"
    finally:
        replica.outputs_idle_s = OUTPUTS_IDLE_S
    for _ in range(200):  # an aborted request's blocks are freed on the engine thread
        if on_loop(replica.check_integrity()) == 0:
            break
        time.sleep(0.05)
    assert on_loop(replica.check_integrity()) == 0


def test_a_replica_freezes_its_built_heap_only_when_told(monkeypatch):
    import pagedkv.deploy.replica as replica_module

    calls = []
    monkeypatch.setattr(replica_module, "gc_freeze_heap", lambda: calls.append("frozen"))
    for freeze in (False, True):
        replica = EngineReplica(EngineConfig(**OPTIONS), engine_process=False, freeze_heap=freeze)
        replica.__del__()
    assert calls == ["frozen"]


def test_an_engine_process_that_dies_fails_its_requests_and_its_health_check():
    """The loop reads the child's pipe: at its EOF the open requests end with a failure, never hang."""
    replica = EngineReplica(EngineConfig(**OPTIONS), engine_process=True, engine_thread=False)
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def run():
        reader = asyncio.create_task(replica.outputs("doomed").__anext__())
        call = replica.generate("doomed", PROMPTS[2], long, sender="doomed")
        assert await call.__anext__() == "local"
        await reader  # it streams
        replica._process.process.kill()
        with pytest.raises(StopAsyncIteration):  # the call ends (its failure went to the sender)
            await asyncio.wait_for(call.__anext__(), 30)
        messages = []
        async for blob, _ in replica.outputs("doomed"):
            messages.extend(unpack_messages(blob))
            if any(m[0] == "failed" for m in messages):
                break
        return [m for m in messages if m[0] == "failed"]

    try:
        (failed,) = on_loop(asyncio.wait_for(run(), 60))
        assert failed[1] == "doomed" and "died" in failed[2]
        with pytest.raises(Exception, match="engine process"):
            replica.check_health()
    finally:
        replica.__del__()


def test_a_replica_built_on_another_threads_loop_serves_on_its_calls_loop():
    """Ray Serve may run the constructor on a thread and loop other than its calls': the engine process's front
    (its pipe reader, its streams) belongs to the calls' loop, so every request under load arrives whole."""
    import concurrent.futures

    async def build():
        return EngineReplica(EngineConfig(**OPTIONS), engine_process=True, engine_thread=False)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        replica = pool.submit(asyncio.run, build()).result(120)
    try:
        calls = [(f"x{i}", PROMPTS[i % 3] + [i + 30], GREEDY) for i in range(24)]
        done, failed = on_loop(_serve(replica, calls, sender="other-loop"))
        assert not failed and len(done) == len(calls)
        assert all(len(output.outputs[0].token_ids) == GREEDY.max_tokens for output in done.values())
        assert on_loop(replica.check_integrity()) == 0
    finally:
        replica.__del__()


def test_under_uvloop_the_engine_process_pipe_stays_blocking():
    """uvloop (Ray Serve's loop) makes a watched descriptor non-blocking; the pipe frames whole messages, and a
    read or write cut short by EAGAIN lost messages under load (every request's stream then had a gap)."""
    import os

    uvloop = pytest.importorskip("uvloop")
    replica = EngineReplica(EngineConfig(**OPTIONS), engine_process=True, engine_thread=False)
    loop = uvloop.new_event_loop()
    try:
        done, failed = loop.run_until_complete(_serve(replica, [("uv", PROMPTS[0], GREEDY)], sender="uv"))
        assert not failed and len(done["uv"].outputs[0].token_ids) == GREEDY.max_tokens
        assert os.get_blocking(replica._process.conn.fileno())
    finally:
        replica.__del__()
        loop.close()


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_routing_stats_keep_publishing_a_prefix_spilled_to_the_host_tier(engine_process):
    """The routers' view of a replica (`record_routing_stats`) names a prefix the GPU cache evicted while it
    waits in the host tier (a hit there is a copy, not a prefill)."""
    from pagedkv.distributed.router import prompt_block_hashes

    replica = EngineReplica(EngineConfig(**dict(OPTIONS, num_blocks=12, max_model_len=48,
                                                kv_offload_memory=16 * 2**20)), engine_process=engine_process)
    try:
        prompt = list(range(30, 47))
        filler = list(range(100, 140))  # with its outputs, every GPU block: the prompt's blocks spill
        on_loop(_serve(replica, [("a", prompt, GREEDY)]))
        on_loop(_serve(replica, [("b", filler, GREEDY)]))
        wanted = set(prompt_block_hashes(prompt, OPTIONS["block_size"]))
        deadline = time.monotonic() + 30
        while True:  # an engine process pushes its keys once idle; the parent reads them on its own time
            published = set(on_loop(replica.record_routing_stats())["block_hashes"])
            if wanted <= published or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert wanted <= published
        assert on_loop(replica.describe())["stats"]["kv_offloaded_blocks"] >= len(wanted)  # copied to the host tier
    finally:
        replica.__del__()
