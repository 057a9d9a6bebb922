"""Lanes (`pagedkv.deploy.lane`) into an `EngineReplica` driven directly, without Ray: a request sent in by lane runs
once, its outputs come back on the lane and equal the engine's, its Serve call (pinned to the replica) waits for it,
an abort by lane frees its blocks, a lane that ends takes its sender's requests with it, a wrong token is refused."""

import asyncio
import struct

import pytest

pytest.importorskip("ray")

from test_replica import read_outputs  # noqa: E402

from pagedkv.deploy.lane import LaneAddress, LaneClient, LaneError, frame, read_frame  # noqa: E402
from pagedkv.deploy.replica import EngineReplica  # noqa: E402
from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray

LOOP = asyncio.new_event_loop()
OPTIONS = dict(model="random:tiny-llama", device="cpu", dtype="float32", block_size=4, num_blocks=64,
               max_model_len=64, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
BOUND_S = 60


def on_loop(coro):
    return LOOP.run_until_complete(asyncio.wait_for(coro, BOUND_S))


@pytest.fixture(scope="module", params=["thread", "process"], ids=["engine-thread", "engine-process"])
def replica(request):
    replica = EngineReplica(EngineConfig(**OPTIONS), engine_process=request.param == "process")
    yield replica
    replica.__del__()


async def _connect(replica, sender="s"):
    address = await replica.lane_address()
    assert await replica.lane_address(replica="another") is None  # a call meant for a replica that is gone
    return await LaneClient.connect("local", address, sender)


async def _collect(lane, ids):
    return await read_outputs(lane.messages(), ids)


async def _eventually(condition, seconds: float = 30.0) -> bool:
    """Poll `condition` until it holds or `seconds` pass (a loaded 2-core CI machine can take seconds to drain an
    engine process); its last value."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return condition()


def _idle(replica) -> bool:
    """Nothing running or waiting, read as the replica reads its queues beside the engine thread (an engine
    process's pipe has one reader, the engine thread: calling into the engine from here would race it)."""
    num_waiting, num_running, _ = replica._queues()
    return not replica._tasks and num_waiting == 0 and num_running == 0


def test_requests_by_lane_run_once_and_their_outputs_come_back_on_it(replica):
    async def run():
        lane = await _connect(replica)
        lane.send(("attach",))
        ids = [f"lane-{i}" for i in range(len(PROMPTS))]
        for request_id, prompt in zip(ids, PROMPTS):
            assert lane.send(("add", request_id, prompt, GREEDY, None))
        reading = asyncio.ensure_future(_collect(lane, ids))
        # Each request's Serve call, pinned here, comes after its lane copy: it waits for that one, starts nothing.
        items = [[item async for item in replica.generate(request_id, prompt, GREEDY, sender="s", replica="local")]
                 for request_id, prompt in zip(ids, PROMPTS)]
        done, failed, seen = await reading
        # A call pinned to another replica yields None and starts nothing here.
        assert [item async for item in replica.generate("elsewhere", PROMPTS[0], GREEDY, sender="s",
                                                        replica="another")] == [None]
        # A lane copy that comes after its request ended here does not run it again.
        lane.send(("add", ids[0], PROMPTS[0], GREEDY, None))
        await asyncio.sleep(0.3)
        lane.close()
        return items, done, failed, seen

    started = replica._num_started["s"]
    items, done, failed, seen = on_loop(run())
    assert items == [["local"]] * len(PROMPTS) and not failed
    expected = LLM(**OPTIONS).generate(PROMPTS, GREEDY)
    assert [done[f"lane-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        e.outputs[0].token_ids for e in expected]
    assert replica._num_started["s"] - started == len(PROMPTS)  # each once, though sent twice (three times, one)
    assert "elsewhere" not in seen and "elsewhere" not in replica._gone and not replica._tasks


def test_a_call_that_comes_first_runs_the_request_and_its_late_lane_copy_is_dropped(replica):
    async def run():
        lane = await _connect(replica, sender="t")
        lane.send(("attach",))
        reading = asyncio.ensure_future(_collect(lane, ["first"]))
        items = [item async for item in replica.generate("first", PROMPTS[1], GREEDY, sender="t", replica="local")]
        lane.send(("add", "first", PROMPTS[1], GREEDY, None))  # the lane's copy, late
        done, failed, seen = await reading
        await asyncio.sleep(0.3)
        lane.close()
        return items, done, seen

    started = replica._num_started["t"]
    items, done, seen = on_loop(run())
    assert items == ["local"] and list(done) == ["first"]
    assert replica._num_started["t"] - started == 1


def test_an_abort_by_lane_frees_the_blocks_and_a_closed_lane_takes_its_requests_with_it(replica):
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def run():
        lane = await _connect(replica, sender="u")
        lane.send(("attach",))
        lane.send(("add", "aborted", PROMPTS[0], long, None))
        lane.send(("add", "orphan", PROMPTS[1], long, None))
        messages = lane.messages()
        await messages.__anext__()  # they are generating
        lane.send(("abort", "aborted"))
        aborted_gone = await _eventually(lambda: "aborted" not in replica._tasks)
        orphan_running = "orphan" in replica._tasks
        lane.close()  # the sender went away: nobody can read its requests' outputs
        await _eventually(lambda: _idle(replica))
        return aborted_gone, orphan_running

    aborted_gone, orphan_running = on_loop(run())
    assert aborted_gone and orphan_running
    assert _idle(replica)
    assert on_loop(replica.check_integrity()) == 0


def test_a_lane_with_a_wrong_token_is_refused_and_starts_nothing(replica):
    async def run():
        address = await replica.lane_address()
        again = await asyncio.gather(replica.lane_address(), replica.lane_address())
        assert again == [address, address]  # one server, however many ask at once
        forged = LaneAddress(address.host, address.port, b"0" * 16)
        with pytest.raises((LaneError, asyncio.IncompleteReadError, ConnectionError)):
            await LaneClient.connect("local", forged, "intruder")
        # A peer that sends a huge frame before any token is cut off after the fixed-size hello.
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(struct.pack("!I", 200 << 20) + b"x" * 4096)
        assert await reader.read() == b""  # closed
        writer.close()

    on_loop(run())
    assert "forged" not in replica._tasks and replica._num_started["intruder"] == 0


def test_a_client_does_not_take_a_peer_without_the_token_for_its_replica():
    """A process that took over a replica's port (and heard the client's hello) cannot answer it."""
    async def run():
        async def impostor(reader, writer):
            await reader.readexactly(48)
            writer.write(b"\0" * 32)
            await writer.drain()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(LaneError, match="is not replica"):
            await LaneClient.connect("r1", LaneAddress("127.0.0.1", port, b"k" * 16), "s")
        server.close()

    on_loop(run())


def test_a_frame_over_the_limit_is_an_error_not_an_allocation():
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack("!I", 1 << 31))
        reader.feed_eof()
        with pytest.raises(LaneError, match="over the limit"):
            await read_frame(reader)
        reader = asyncio.StreamReader()
        reader.feed_data(frame(b"abc"))
        reader.feed_eof()
        assert await read_frame(reader) == b"abc" and await read_frame(reader) is None

    on_loop(run())
