"""`PagedKVRequestRouter` over replica stubs (no cluster): what it reads from routing stats, and what it counts itself."""

import asyncio
from dataclasses import dataclass, field

import pytest

ray = pytest.importorskip("ray")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from pagedkv.deploy.request_router import PagedKVRequestRouter  # noqa: E402
from pagedkv.distributed.router import prompt_block_hashes  # noqa: E402

pytestmark = pytest.mark.ray

DEPLOYMENT = DeploymentID(name="PagedKVEngine", app_name="pagedkv")
PROMPT = list(range(100, 133))  # 8 blocks of 4 that can hit


@dataclass
class _Replica:
    """What the router reads of a `RunningReplica`."""

    replica_id: ReplicaID
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 1024


def _replica(name: str, **stats) -> _Replica:
    base = {"num_waiting": 0, "num_running": 0, "num_free_blocks": 100, "num_started": {}, "block_hashes": []}
    return _Replica(ReplicaID(name, DEPLOYMENT), {**base, **stats})


def _router(policy: str = "prefix") -> PagedKVRequestRouter:
    router = PagedKVRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy=policy, block_size=4)
    return router


def _request(prompt: list[int], method: str = "generate") -> PendingRequest:
    metadata = RequestMetadata(request_id="r", internal_request_id="r", call_method=method)
    return PendingRequest(["r", prompt, None], {"block_hashes": prompt_block_hashes(prompt, 4)}, metadata)


def _choose(router, replicas, request):
    """`choose_replicas` to its end; it must not wait on anything (a routing choice is local arithmetic)."""
    call = router.choose_replicas(replicas, request)
    try:
        call.send(None)
    except StopIteration as done:
        return done.value
    call.close()
    raise AssertionError("choose_replicas waited for something")


def _in_loop(test):
    """Run a test body inside an event loop, where Ray Serve builds and calls its routers."""

    def run():
        async def body():
            return test()

        return asyncio.run(body())

    run.__name__ = test.__name__
    return run


@_in_loop
def test_a_prefix_a_replica_reports_cached_wins_over_the_lower_key():
    router = _router()
    holder = _replica("b", block_hashes=prompt_block_hashes(PROMPT, 4)[:5])
    ranks = _choose(router, [_replica("a"), holder], _request(PROMPT + [7]))
    assert [r.replica_id.unique_id for r in ranks[0]] == ["b"]
    assert [r.replica_id.unique_id for r in ranks[1]] == ["a"]  # the fallback if b is full


@_in_loop
def test_requests_sent_but_not_yet_started_count_as_waiting():
    # Both replicas report idle queues (stats are only refreshed every period): without counting what it sent,
    # the router would send a whole burst of misses to the same "least loaded" replica.
    router = _router("least_loaded")
    replicas = [_replica("a"), _replica("b")]
    chosen = []
    for i in range(6):
        request = _request([i, 1, 2])
        (first, *_) = _choose(router, replicas, request)
        chosen.append(first[0].replica_id.unique_id)
        router.on_send_request(first[0].replica_id)
        assert request.kwargs["sender"] == router.sender  # the replica counts this router's requests by it
    assert chosen.count("a") == chosen.count("b") == 3
    # Once a replica reports that it has started them, they count through its queues instead.
    started = {"a": _replica("a", num_started={router.sender: 3}, num_waiting=3),
               "b": _replica("b", num_started={router.sender: 3})}
    (first, *_) = _choose(router, list(started.values()), _request([9, 1, 2]))
    assert first[0].replica_id.unique_id == "b"  # a reports them waiting: b is the less loaded


@_in_loop
def test_a_replica_that_left_is_forgotten():
    router = _router("round_robin")
    a, b = _replica("a"), _replica("b")
    router.on_send_request(a.replica_id)
    router.update_replicas([b])
    assert dict(router._num_sent) == {}
    (first,) = _choose(router, [b], _request([1, 2, 3]))
    assert first[0] is b


@_in_loop
def test_calls_other_than_generate_carry_no_prompt_and_no_sender():
    router = _router()
    request = _request(PROMPT, method="describe")
    request.kwargs.clear()
    (first, *_) = _choose(router, [_replica("a"), _replica("b")], request)
    assert first[0].replica_id.unique_id == "a" and "sender" not in request.kwargs


@_in_loop
def test_an_output_stream_goes_to_the_replica_it_names_and_a_request_keeps_its_ingress_name():
    router = _router()
    replicas = [_replica("a"), _replica("b"), _replica("c")]
    request = PendingRequest(["ingress-1"], {"replica": "b"},
                             RequestMetadata(request_id="o", internal_request_id="o", call_method="outputs"))
    assert [[r.replica_id.unique_id for r in rank] for rank in _choose(router, replicas, request)] == [["b"]]
    # A replica that has gone: any will do (the one that takes it ends the stream, so the ingress sees it gone).
    request.kwargs["replica"] = "gone"
    assert len(_choose(router, replicas, request)[0]) == 3
    generate = _request(PROMPT)
    generate.kwargs["sender"] = "ingress-1"
    _choose(router, replicas, generate)
    assert generate.kwargs["sender"] == router.sender == "ingress-1"  # counted under the ingress's own name
