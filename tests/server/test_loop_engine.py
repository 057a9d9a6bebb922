"""`LoopAsyncEngine`: an engine client on the app's own event loop, driven without an engine thread.

A scripted client stands in for the Ray ingress's `RayEngineClient`: its calls must arrive on
the loop, it hands outputs to the attached sink there. Requests reach their streams, one that
the engine refuses or whose output cannot be delivered fails alone, commands from other
threads are handed to the loop, and a stop ends every open stream.
"""

import asyncio
import concurrent.futures
import threading

import pytest

from pagedkv.engine.client import QueueSizes
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import EngineDeadError, InvalidArgumentError
from pagedkv.server.async_engine import AsyncEngine, _Call
from pagedkv.server.loop_engine import LoopAsyncEngine, runs_on_this_loop
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.request_stream import RequestFailedError, RequestStream, ShuttingDownError


class _Stats:
    """An engine's counters, all zero: what the metrics mirror reads."""

    num_blocks = 64

    def __getattr__(self, name):
        return 0


class _Client:
    """Answers each request with `num_tokens` outputs, one per turn of the loop; refuses prompts holding 0."""

    def __init__(self, loop, num_tokens: int = 3):
        self.event_loop, self.num_tokens = loop, num_tokens
        self.sink = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()

    def attach(self, sink):
        self.sink = sink

    def add_request(self, request_id, token_ids, params):
        self.threads.add(threading.get_ident())
        if 0 in token_ids:
            raise InvalidArgumentError(f"token id 0 is not allowed (request {request_id})")
        self.tasks[request_id] = self.event_loop.create_task(self._run(request_id))

    async def _run(self, request_id):
        for k in range(1, self.num_tokens + 1):
            await asyncio.sleep(0)
            done = k == self.num_tokens
            self.sink(RequestOutput(request_id, None, [1], [CompletionOutput(0, "x" * k, list(range(k)),
                                                                           "length" if done else None)], done))

    def abort(self, request_id):
        self.threads.add(threading.get_ident())
        self.aborted.append(request_id)
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        return task is not None

    def has_unfinished_requests(self):
        return any(not t.done() for t in self.tasks.values())

    def stats(self):
        return _Stats()

    def latest_stats(self):
        return _Stats()

    def health(self):
        return []

    def queue_sizes(self):
        return QueueSizes(0, sum(not t.done() for t in self.tasks.values()), 0)


async def _collect(stream: RequestStream) -> list:
    items = []
    while True:
        try:
            item = await stream.get(timeout_s=5)
        except (RequestFailedError, ShuttingDownError) as error:
            return items + [error]
        items.append(item)
        if item.finished:
            return items


def test_it_is_chosen_only_for_an_engine_on_the_running_loop():
    async def check():
        loop = asyncio.get_running_loop()
        assert runs_on_this_loop(_Client(loop))
        assert not runs_on_this_loop(_Client(asyncio.new_event_loop()))
        assert not runs_on_this_loop(object())

    asyncio.run(check())
    assert not runs_on_this_loop(_Client(asyncio.new_event_loop()))  # no loop running here


def test_outputs_reach_their_streams_on_the_loop_and_a_refused_request_fails_alone():
    async def run():
        loop = asyncio.get_running_loop()
        client, metrics = _Client(loop), ServerMetrics()
        front = LoopAsyncEngine(client, metrics)
        front.start()
        streams = {rid: RequestStream(loop) for rid in ("a", "bad", "c")}
        for rid, stream in streams.items():
            front.add_request(rid, [0] if rid == "bad" else [5, 6], SamplingParams(max_tokens=3), stream)
        results = {rid: await _collect(stream) for rid, stream in streams.items()}
        assert client.threads == {threading.get_ident()}  # every engine call on the loop's thread
        for rid in ("a", "c"):
            assert results[rid][-1].finished and results[rid][-1].outputs[0].token_ids == [0, 1, 2]
        refused = results["bad"][-1]
        assert isinstance(refused, RequestFailedError) and refused.status_code == 400 and "token id 0" in str(refused)
        assert front.num_waiting == 0 and not front._tracked
        rendered = metrics.render().decode()
        assert any('finished_reason="length"' in line and line.endswith(" 2.0") for line in rendered.splitlines())
        front.stop()

    asyncio.run(run())


def test_commands_from_other_threads_are_handed_to_the_loop_and_stop_ends_open_streams():
    async def run():
        loop = asyncio.get_running_loop()
        client = _Client(loop, num_tokens=10 ** 6)  # streams until stopped
        front = LoopAsyncEngine(client)
        front.start()
        stream = RequestStream(loop)
        await asyncio.to_thread(front.add_request, "a", [5], SamplingParams(max_tokens=8), stream)
        first = await stream.get(timeout_s=5)
        assert first.request_id == "a" and not first.finished
        assert await asyncio.wrap_future(await asyncio.to_thread(front.call, lambda engine: engine is client))
        await asyncio.to_thread(front.stop)  # as the app's lifespan stops it: off the loop
        items = await _collect(stream)
        assert isinstance(items[-1], ShuttingDownError)
        assert client.aborted == ["a"] and client.threads == {threading.get_ident()}
        assert not front.is_alive
        with pytest.raises(ShuttingDownError):
            front.add_request("b", [5], SamplingParams(max_tokens=1), RequestStream(loop))
        late = _Call(lambda engine: 1, concurrent.futures.Future())  # handed over from a thread, run after stop
        front._run_command(late)
        with pytest.raises(EngineDeadError):
            late.future.result(timeout=1)

    asyncio.run(run())


def test_an_output_that_cannot_be_delivered_fails_its_request_alone():
    async def run():
        loop = asyncio.get_running_loop()
        client = _Client(loop)
        front = LoopAsyncEngine(client)
        front.start()
        good, bad = RequestStream(loop), RequestStream(loop)
        front.add_request("good", [5], SamplingParams(max_tokens=3), good)
        front.add_request("bad", [5], SamplingParams(max_tokens=3), bad)
        real_sink = client.sink

        def sink(output):
            if output.request_id == "bad":
                output.outputs = None  # unreadable: delivering it raises
            real_sink(output)

        client.sink = sink
        assert isinstance((await _collect(bad))[-1], RequestFailedError)
        assert (await _collect(good))[-1].finished
        assert "bad" in client.aborted
        front.stop()

    asyncio.run(run())


def test_the_threaded_front_stays_the_default_for_an_engine_of_its_own():
    assert issubclass(LoopAsyncEngine, AsyncEngine)
    assert not runs_on_this_loop(type("Engine", (), {"event_loop": None, "attach": None})())


def test_it_refuses_to_start_off_its_engines_loop():
    with pytest.raises(EngineDeadError, match="event loop"):
        LoopAsyncEngine(_Client(asyncio.new_event_loop())).start()


def test_a_stream_of_another_loop_gets_its_outputs_through_that_loop():
    """A caller on a thread and loop of its own: its stream's items are handed to its loop, never put from the
    front's (an asyncio stream touched from two threads loses wake-ups and items)."""
    front_loop = asyncio.new_event_loop()
    started = threading.Event()
    threading.Thread(target=lambda: (front_loop.call_soon(started.set), front_loop.run_forever()), daemon=True).start()
    started.wait(5)
    client = _Client(front_loop, num_tokens=5)
    front = LoopAsyncEngine(client)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), front_loop).result(5)
    front_loop.call_soon_threadsafe(front.start)
    try:
        async def run():
            stream = RequestStream(asyncio.get_running_loop())
            put_from = set()
            put = stream.put
            stream.put = lambda item: (put_from.add(threading.get_ident()), put(item))
            for _ in range(100):  # the start is handed to the front's loop
                if front.is_alive:
                    break
                await asyncio.sleep(0.01)
            front.add_request("far", [5, 6], SamplingParams(max_tokens=5), stream)
            items = await _collect(stream)
            return items, put_from

        items, put_from = asyncio.run(run())
        assert items[-1].finished and items[-1].outputs[0].token_ids == [0, 1, 2, 3, 4]
        assert put_from == {threading.get_ident()}  # every item put on the stream's own loop's thread
    finally:
        front_loop.call_soon_threadsafe(front.stop)
        front_loop.call_soon_threadsafe(front_loop.stop)
