"""`RayEngineClient` over a scripted handle (no cluster): retries before the first output, fails after it, aborts."""

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402

from pagedkv.deploy.ray_client import RayEngineClient, take_queued  # noqa: E402
from pagedkv.deploy.replica import Load, pack_messages  # noqa: E402
from pagedkv.distributed.output_deltas import DeltaEncoder, to_wire  # noqa: E402
from pagedkv.distributed.router import prompt_block_hashes  # noqa: E402
from pagedkv.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedkv.engine.sampling_params import SamplingParams  # noqa: E402
from pagedkv.engine.scheduler_types import SchedulerConfig  # noqa: E402

pytestmark = pytest.mark.ray


class _OnLoop:
    """A `RayEngineClient` as the ingress runs it under `LoopAsyncEngine`: built on a loop it does not own, its
    outputs handed to a sink as they arrive, `add_request` and `abort` called on that loop. It answers the calls
    the tests make of a threaded client, so every scripted case below runs both ways."""

    def __init__(self, *args, **kwargs):
        import queue
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.outputs = queue.SimpleQueue()
        self.client = RealClient(*args, loop=self.loop, drive_on_loop=True, **kwargs)
        assert self.client.event_loop is self.loop
        self.client.attach(self.outputs.put)

    def _on_loop(self, fn, *args):
        async def call():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=10)

    def add_request(self, *args, **kwargs):
        return self._on_loop(lambda: self.client.add_request(*args, **kwargs))

    def abort(self, request_id):
        return self._on_loop(self.client.abort, request_id)

    def step(self, timeout_s: float = 0.05):
        return take_queued(self.outputs, timeout_s)

    def has_unfinished_requests(self):  # outputs not yet taken count, as a threaded client's queue does
        return self.client.has_unfinished_requests() or not self.outputs.empty()

    def shutdown(self):
        self.client.shutdown()
        time.sleep(0.05)  # the cancelled streams end on the loop
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def __getattr__(self, name):
        return getattr(self.client, name)


RealClient = RayEngineClient


@pytest.fixture(autouse=True, params=["own-thread", "owners-loop"])
def client_placement(request, monkeypatch):
    """Each test with the client on a loop of its own (queued for step()) and on its owner's loop (a sink)."""
    if request.param == "owners-loop":
        monkeypatch.setitem(globals(), "RayEngineClient", _OnLoop)
    return request.param

INFO = {"max_model_len": 64, "vocab_size": 512, "block_size": 4, "replica": "r0",
        "scheduler_config": SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64),
        "stats": {"num_blocks": 64, "num_used_blocks": 0, "block_size": 4, "tokens_per_second": 0.0}}


def _output(request_id: str, tokens: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2, 3], [CompletionOutput(0, "", tokens, "length" if finished else None)],
                         finished)


class _Call:
    """One scripted `generate` call on replica `replica`: names the replica, then queues `script`'s messages for
    the output stream (an exception is raised on the call; "hang" waits until cancelled; ("break", error) breaks
    the output stream with `error`; "end" ends it), then ends."""

    def __init__(self, replica: "_Replica", script, request_id: str):
        self.replica, self.script, self.request_id = replica, script, request_id
        self.cancelled = False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        import asyncio

        yield self.replica.name
        for item in self.script:
            if isinstance(item, tuple) and item[0] == "output":  # under the id this call was made with
                item = ("output", (self.request_id, *item[1][1:]))  # a wire delta: its id first
            if isinstance(item, BaseException):
                raise item
            if item == "hang":
                await asyncio.sleep(3600)
            self.replica.outbox.put_nowait(item[1] if item[0] == "break" else item)
            self.replica.num_streamed += 1
            await asyncio.sleep(0)

    def cancel(self):
        self.cancelled = True


class _Replica:
    """A scripted replica: one output stream (the `outputs` call), fed by the `generate` calls' scripts."""

    def __init__(self, name: str):
        import asyncio

        self.name = name
        self.outbox = asyncio.Queue()  # what the replica holds for the stream until it is read
        self.num_streamed = 0
        self.num_streams = 0  # `outputs` calls opened

    def outputs(self, replica: str):
        assert replica == self.name
        self.num_streams += 1

        async def run():
            while True:
                message = await self.outbox.get()
                if isinstance(message, BaseException):  # the stream breaks (the replica lives on)
                    raise message
                if message == "end":  # the replica ends the stream (it was idle)
                    return
                (blob,) = pack_messages([message])
                yield blob, Load(self.name, "n1", 0, 1, 60, None)

        return _Stream(run())


class _Stream:
    """An `outputs` call: iterated, or cancelled (as the client does when it closes its streams)."""

    def __init__(self, items):
        self.items, self.cancelled = items, False

    def __aiter__(self):
        return self.items

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, remote):
        self.remote = remote


class _Handle:
    """A deployment handle whose `generate.remote` calls play `scripts` in turn (each on a replica of its own),
    recording their arguments; `outputs.remote` opens the named replica's output stream."""

    app_name, deployment_name = "app", "engine"

    def __init__(self, scripts, one_replica: bool = False):
        self.scripts = list(scripts)
        self.one_replica = one_replica  # every call on replica r0, else each on a replica of its own
        self.replicas: dict[str, _Replica] = {}
        self.calls: list[tuple] = []
        self.generate = _Method(self._generate)
        self.outputs = _Method(self._outputs)

    def options(self, stream: bool, _by_reference: bool = True):
        self.by_reference = _by_reference  # (the client's unary handle, for lane addresses, is never called here)
        return self

    def _generate(self, *args, **kwargs):
        name = "r0" if self.one_replica else f"r{len(self.calls)}"
        self.replicas.setdefault(name, _Replica(name))
        call = _Call(self.replicas[name], self.scripts.pop(0), args[0])
        self.calls.append((args, kwargs, call))
        return call

    def _outputs(self, sender: str, replica: str):
        assert sender == self.calls[0][1]["sender"]
        return self.replicas[replica].outputs(replica)


def _messages(request_id: str, num_tokens: int) -> list:
    encoder = DeltaEncoder(send_prompt_token_ids=False)  # as a replica encodes them
    return [("output", to_wire(encoder.encode(_output(request_id, list(range(5, 5 + k)), k == num_tokens))))
            for k in range(1, num_tokens + 1)]


def _until(predicate, within_s: float = 10.0) -> bool:
    """Whether `predicate()` holds within `within_s` (polled)."""
    deadline = time.monotonic() + within_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def _cancelled(call: _Call) -> bool:
    """Whether the client cancels `call` (the cancellation reaches the replica, which aborts the request there)."""
    return _until(lambda: call.cancelled)


def _drain(client, until_s: float = 10.0) -> list[RequestOutput]:
    outputs, deadline = [], time.monotonic() + until_s
    while client.has_unfinished_requests() and time.monotonic() < deadline:
        outputs += client.step()
    return outputs


def test_a_replica_that_dies_before_the_first_output_is_retried_and_the_prompt_hashed_once():
    handle = _Handle([[ActorDiedError()], _messages("a", 3)])
    client = RayEngineClient(handle, INFO, None, max_attempts=3)
    try:
        prompt = list(range(10, 23))
        client.add_request("a", prompt, SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert [o.outputs[0].token_ids for o in outputs][-1] == [5, 6, 7] and outputs[-1].error is None
        assert outputs[-1].prompt_token_ids == prompt  # the client's own: a replica does not send them back
        assert len(handle.calls) == 2  # the first replica failed; the second served it
        for args, kwargs, _ in handle.calls:
            assert args[1] == prompt and kwargs["block_hashes"] == prompt_block_hashes(prompt, 4)
        assert client.queue_sizes().num_running == 1  # the load the replica's last output carried
    finally:
        client.shutdown()


def test_a_replica_that_dies_mid_stream_fails_the_request_without_a_retry():
    handle = _Handle([_messages("a", 3)[:1] + [ActorDiedError()], _messages("a", 3)])
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert outputs[0].outputs[0].token_ids == [5]
        assert outputs[-1].finished and "failed" in outputs[-1].error
        assert len(handle.calls) == 1  # the client had a token already: a retry would repeat it
    finally:
        client.shutdown()


def test_retries_end_after_max_attempts():
    handle = _Handle([[ActorDiedError()], [ActorDiedError()]])
    client = RayEngineClient(handle, INFO, None, max_attempts=2)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert len(outputs) == 1 and outputs[0].finished and outputs[0].error
        assert len(handle.calls) == 2
    finally:
        client.shutdown()


def test_abort_cancels_the_call_and_drops_later_outputs():
    handle = _Handle([_messages("a", 3)[:1] + ["hang"]])
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        deadline = time.monotonic() + 10
        first = []
        while not first and time.monotonic() < deadline:
            first = client.step()
        assert first and not first[0].finished
        assert client.abort("a") and not client.abort("a")
        assert _cancelled(handle.calls[0][2])  # the cancellation goes on to the replica, which aborts it there
        assert not client.has_unfinished_requests() and client.step(timeout_s=0.01) == []
    finally:
        client.shutdown()


def test_bad_requests_are_refused_before_any_call():
    handle = _Handle([])
    client = RayEngineClient(handle, INFO, None)
    try:
        with pytest.raises(Exception, match="vocab"):
            client.add_request("a", [1, 600], SamplingParams(max_tokens=3))
        with pytest.raises(Exception, match="64"):
            client.add_request("b", list(range(1, 70)), SamplingParams(max_tokens=3))
        assert handle.calls == [] and not client.has_unfinished_requests()
    finally:
        client.shutdown()


def test_outputs_of_many_requests_come_on_one_stream_per_replica():
    scripts = [_messages(rid, 4) for rid in "abcde"]
    handle = _Handle(scripts)
    client = RayEngineClient(handle, INFO, None)
    try:
        for rid in "abcde":
            client.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=4))
        outputs = _drain(client)
        finals = {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
        assert finals == {rid: [5, 6, 7, 8] for rid in "abcde"} and all(o.error is None for o in outputs)
        senders = {kwargs["sender"] for _, kwargs, _ in handle.calls}
        assert len(senders) == 1  # every call names the same ingress, whose streams the replicas key by it
    finally:
        client.shutdown()
    client.shutdown()  # idempotent


def test_a_request_whose_replica_stream_ends_before_its_last_output_fails_and_does_not_hang():
    handle = _Handle([_messages("a", 3)[:1]])  # the call ends after one output; the final never comes
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        deadline = time.monotonic() + 10
        while "r0" not in handle.replicas or not handle.replicas["r0"].outbox.empty():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.05)
        assert client.has_unfinished_requests()  # waiting for its last output on the stream
        asyncio.run_coroutine_threadsafe(client._close_channels(), client._loop).result(timeout=10)
        outputs = _drain(client)
        assert outputs[-1].finished and "output stream ended" in outputs[-1].error
        assert not client.has_unfinished_requests()
    finally:
        client.shutdown()


@pytest.mark.parametrize("grpc, by_reference", [(None, False), (True, False), (False, True)])
def test_the_client_calls_replicas_over_the_transport_it_is_given(grpc, by_reference):
    handle = _Handle([_messages("a", 2)])
    client = RayEngineClient(handle, INFO, None, **({} if grpc is None else {"grpc": grpc}))
    try:
        assert handle.by_reference is by_reference  # Serve's gRPC channel unless told otherwise
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
        assert [o.outputs[0].token_ids for o in _drain(client)][-1] == [5, 6]
    finally:
        client.shutdown()


def test_a_broken_output_stream_fails_its_started_requests_at_once_and_cancels_them_at_the_replica():
    # The replica lives on (its calls stay open), but its output stream broke, as when the transport refuses a
    # message: the request that had output may have lost some, so it fails now and is aborted there.
    handle = _Handle([_messages("a", 3)[:1] + [("break", RuntimeError("RESOURCE_EXHAUSTED")), "hang"]])
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert outputs[0].outputs[0].token_ids == [5]
        assert outputs[-1].finished and "RESOURCE_EXHAUSTED" in outputs[-1].error
        assert not client.has_unfinished_requests()
        assert _cancelled(handle.calls[0][2]) and len(handle.calls) == 1  # aborted there; not retried
    finally:
        client.shutdown()


def test_a_stream_the_replica_ends_is_reopened_for_the_request_still_waiting_on_it():
    # "a" is answered on r0's stream; then r0 ends that stream (idle, as a replica does), with "b" already
    # sent there and nothing of it out yet: the client opens a new stream, and b's outputs come on it.
    handle = _Handle([_messages("a", 2), ["end"] + _messages("b", 3)], one_replica=True)
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
        assert _drain(client)[-1].outputs[0].token_ids == [5, 6]
        client.add_request("b", [1, 2, 3], SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert outputs[-1].finished and outputs[-1].error is None and outputs[-1].outputs[0].token_ids == [5, 6, 7]
        assert handle.replicas["r0"].num_streams == 2
    finally:
        client.shutdown()


def test_a_request_with_no_output_when_its_stream_broke_is_retried_and_the_old_attempts_output_dropped():
    # "b" is answered on r0's stream. Then the stream breaks while "a" has shown nothing (its first output may
    # have gone down with it): its call is cancelled and it is retried under an id of its own, and an output of
    # the first attempt that still comes (on the stream the client reopened at once) is not taken for it.
    handle = _Handle([_messages("b", 2), [("break", RuntimeError("RESOURCE_EXHAUSTED")), _messages("a", 3)[1],
                                          "hang"], _messages("a", 3)], one_replica=True)
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
        assert _drain(client)[-1].outputs[0].token_ids == [5, 6]
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert [o.outputs[0].token_ids for o in outputs] == [[5], [5, 6], [5, 6, 7]] and outputs[-1].error is None
        assert {o.request_id for o in outputs} == {"a"}
        assert _cancelled(handle.calls[1][2]) and len(handle.calls) == 3
        assert handle.calls[2][0][0] != "a" and handle.calls[2][0][0].startswith("a#")  # the retry's own id
    finally:
        client.shutdown()


def test_an_output_that_continues_from_a_lost_one_fails_its_request_rather_than_show_a_gap():
    first, _, third = _messages("a", 3)
    handle = _Handle([[first, third, "hang"]])
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert [o.outputs[0].token_ids for o in outputs[:-1]] == [[5]]
        assert outputs[-1].finished and "lost" in outputs[-1].error
        assert _cancelled(handle.calls[0][2]) and len(handle.calls) == 1  # aborted there; not retried
    finally:
        client.shutdown()


def test_a_request_whose_only_output_went_down_with_a_broken_stream_is_retried_not_left_hanging():
    # "a" wants one token: its first output is its last, and it is in the message the broken stream lost.
    handle = _Handle([_messages("b", 2), [("break", RuntimeError("RESOURCE_EXHAUSTED")), "hang"], _messages("a", 1)],
                     one_replica=True)
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
        _drain(client)
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
        outputs = _drain(client)
        assert outputs[-1].finished and outputs[-1].error is None and outputs[-1].outputs[0].token_ids == [5]
        assert not client.has_unfinished_requests() and len(handle.calls) == 3
    finally:
        client.shutdown()


def test_an_abort_in_the_same_turn_as_a_broken_stream_is_not_retried():
    handle = _Handle([_messages("b", 2), ["hang"], ["hang"]], one_replica=True)
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
        _drain(client)
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        assert _until(lambda: any(live.request_id == "a" and live.replica == "r0" for live in client._live.values()))

        future = client._requests.pop("a")  # what abort() does on the engine thread, then on the loop:

        def break_and_abort():  # the stream breaks and the abort lands in one turn: two cancellations of "a"
            handle.replicas["r0"].outbox.put_nowait(RuntimeError("RESOURCE_EXHAUSTED"))
            future.cancel()

        client._loop.call_soon_threadsafe(break_and_abort)
        assert _cancelled(handle.calls[1][2])
        time.sleep(0.5)  # past the retry backoff
        assert len(handle.calls) == 2 and not client.has_unfinished_requests()  # aborted: never sent again
    finally:
        client.shutdown()


def test_a_request_whose_last_output_never_comes_is_retried_after_two_streams():
    # "b"'s call ended at r0 but none of its messages come (another reader took them). Later streams bring other
    # requests' outputs and end cleanly; "b" waits for at most its stream and the one after, then is sent again.
    handle = _Handle([_messages("c1", 2), [], ["end"] + _messages("c2", 2), ["end"] + _messages("c3", 2),
                      _messages("b", 2)], one_replica=True)
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("c1", [1, 2, 3], SamplingParams(max_tokens=2))
        _drain(client)
        client.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
        assert _until(lambda: len(handle.calls) == 2)
        outputs = []
        for request_id in ("c2", "c3"):
            client.add_request(request_id, [1, 2, 3], SamplingParams(max_tokens=2))
            outputs += _drain(client, until_s=3) if request_id == "c3" else [o for _ in range(50) for o in
                                                                              client.step(timeout_s=0.01)]
        outputs += _drain(client)
        final = [o for o in outputs if o.request_id == "b" and o.finished]
        assert final and final[-1].error is None and final[-1].outputs[0].token_ids == [5, 6]
        assert handle.calls[-1][0][0].startswith("b#")  # sent again, under an id of its own
    finally:
        client.shutdown()


def test_a_gap_before_anything_was_shown_retries_the_request():
    handle = _Handle([[_messages("a", 3)[1], "hang"], _messages("a", 3)])  # its first output never came
    client = RayEngineClient(handle, INFO, None)
    try:
        client.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
        outputs = _drain(client)
        assert outputs[-1].error is None and outputs[-1].outputs[0].token_ids == [5, 6, 7]
        assert _cancelled(handle.calls[0][2]) and len(handle.calls) == 2
    finally:
        client.shutdown()
