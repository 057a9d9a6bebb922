"""The hand-off from the engine thread to a request's consumer: one wake-up per step, newest output wins."""

import asyncio
import threading

import pytest

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.server.request_stream import RequestFailedError, RequestStream, deliver_threadsafe


def _output(request_id: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, [1], [CompletionOutput(0, "", tokens, "length" if finished else None)],
                         finished)


def test_a_consumer_behind_gets_the_newest_output_of_each_request_in_order():
    async def run():
        stream = RequestStream(asyncio.get_running_loop())
        items = [_output("a", [5]), _output("a", [5, 6]), _output("b", [7]), _output("a", [5, 6, 8], True),
                 RequestFailedError("b failed"), _output("b", [7, 9])]
        thread = threading.Thread(target=deliver_threadsafe,
                                  args=(asyncio.get_running_loop(), [(stream, item) for item in items]))
        thread.start()
        thread.join()
        got = [await stream.get(1.0), await stream.get(1.0), await stream.get(1.0)]
        with pytest.raises(RequestFailedError, match="b failed"):
            await stream.get(1.0)
        got.append(await stream.get(1.0))
        return got

    got = asyncio.run(run())
    # a's first two merge into the second (it holds both tokens); b interrupts; a's last is its final output;
    # an error is never merged away, and nothing after it merges across it.
    assert [(o.request_id, o.outputs[0].token_ids, o.finished) for o in got] == [
        ("a", [5, 6], False), ("b", [7], False), ("a", [5, 6, 8], True), ("b", [7, 9], False)]


def test_one_wake_up_delivers_a_whole_step_to_many_streams():
    async def run():
        loop = asyncio.get_running_loop()
        streams = [RequestStream(loop) for _ in range(64)]
        wakeups = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            wakeups.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        thread = threading.Thread(target=deliver_threadsafe,
                                  args=(loop, [(s, _output(f"r{i}", [i])) for i, s in enumerate(streams)]))
        thread.start()
        thread.join()
        outputs = [await s.get(1.0) for s in streams]
        return len(wakeups), outputs

    num_wakeups, outputs = asyncio.run(run())
    assert num_wakeups == 1
    assert [o.outputs[0].token_ids for o in outputs] == [[i] for i in range(64)]
