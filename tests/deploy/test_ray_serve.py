"""The Ray Serve app on a two-node `ray.cluster_utils.Cluster`: answers, routing, faults, autoscaling.

One cluster for the whole module (starting Ray and the replicas costs more than every test
here together), with two applications deployed at once: `pagedkv` with two fixed replicas,
one on each node, and `scaling` (autoscaling between one and two replicas, short delays). The
tests run in file order; each but the node removal leaves `pagedkv` serving with two replicas.
"""

import json
import math
import os
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

ray = pytest.importorskip("ray")

from fastapi.testclient import TestClient  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # noqa: E402

from pagedkv.deploy.ray_serve import ENGINE_DEPLOYMENT, RayServeConfig, build_app  # noqa: E402
from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.engine import LLMEngine  # noqa: E402
from pagedkv.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.ray

APP = "pagedkv"
SCALING_APP = "scaling"
MODEL = "random:tiny-llama"
OPTIONS = dict(model=MODEL, device="cpu", block_size=4, num_blocks=256)
# Its replicas run their engines in child processes (the default on CUDA), each driven by an engine thread; the
# scaling app's too, each driven from its replica's event loop (`replica_engine_thread=False`).
FIXED = RayServeConfig(min_replicas=2, max_replicas=2, cpus_per_replica=1, ingress_cpus=0.5,
                       routing_stats_period_s=0.2, health_check_period_s=1.0, engine_process=True)
# No CPU reservation: its replicas fit anywhere, and leave the fixed app's layout alone.
SCALING = RayServeConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.5,
                         downscale_delay_s=2.0, cpus_per_replica=0, ingress_cpus=0, routing_stats_period_s=0.2,
                         health_check_period_s=1.0, engine_process=True, replica_engine_thread=False,
                         ingress_engine_thread=False)  # its ingress: LoopAsyncEngine
BOUND_S = 120  # no client may wait longer than this, whatever fails
WAIT_S = 240  # for Ray to restart, add or remove a replica (a replica's start loads torch and the model)


@dataclass
class Deployed:
    url: str
    cluster: Cluster
    worker: object  # the second node (its removal is a test)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replicas(app: str = APP) -> list[dict]:
    """The engine replicas of `app` as the Serve controller reports them."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_serve_instance_details.remote())
    return details["applications"][app]["deployments"][ENGINE_DEPLOYMENT]["replicas"]


def running(app: str = APP) -> list[dict]:
    return [r for r in replicas(app) if getattr(r["state"], "value", r["state"]) == "RUNNING"]


def replica_stats() -> dict[str, dict]:
    """Each running replica's routing stats, asked of its actor directly: queues, free blocks, requests started."""
    return {r["replica_id"]: ray.get(ray.get_actor(r["actor_name"], namespace=SERVE_NAMESPACE)
                                     .record_routing_stats.remote(), timeout=30) for r in running()}


def wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def num_started(stats: dict) -> int:
    return sum(stats["num_started"].values())


#: For the cluster's processes: a loaded machine can take a while to start a worker, and killing workers for
#: memory (the whole machine's, shared by both simulated nodes) is not what these tests are about.
RAY_ENV = {"RAY_worker_register_timeout_seconds": "300", "RAY_memory_monitor_refresh_ms": "0"}


def _start_cluster(attempts: int = 3):
    """Head and worker node. Ray gives a raylet 30 s (fixed) to register; a loaded machine may need another go."""
    for attempt in range(attempts):
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=2, include_dashboard=False)
            return cluster, cluster.add_node(num_cpus=1)
        except Exception:  # noqa: BLE001 - "The current node timed out during startup": retried, then raised
            cluster.shutdown()
            if attempt == attempts - 1:
                raise


@pytest.fixture(scope="module")
def app():
    # Head: the controller, proxy, ingress (0.5 CPU) and one replica; the worker node: one replica.
    saved = {key: os.environ.get(key) for key in RAY_ENV}
    os.environ.update(RAY_ENV)
    cluster, worker = _start_cluster()
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    port = _free_port()
    # One HTTP proxy, on the head: both simulated nodes are this machine, so a proxy per node would share a port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run_many([serve.RunTarget(build_app(EngineConfig(**OPTIONS), FIXED), APP, "/"),
                    serve.RunTarget(build_app(EngineConfig(**OPTIONS), SCALING), SCALING_APP, f"/{SCALING_APP}")])
    try:
        yield Deployed(f"http://127.0.0.1:{port}", cluster, worker)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def local():
    """`pagedkv serve`'s app over one in-process engine with the same config: the reference.

    One torch thread, as in a Ray worker (Ray sets OMP_NUM_THREADS to the actor's CPUs), so both
    sides sum in the same order: a random model's flat distribution has near-ties that the last
    bits can flip.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with TestClient(create_app(LLMEngine(EngineConfig(**OPTIONS)), MODEL)) as client:
            yield client
    finally:
        torch.set_num_threads(threads)


def _events(response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def _comparable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _same(got, want) -> bool:
    """Equal, except that floats (logprobs) may differ in rounding: a prompt served from the prefix cache on
    one replica and computed anew on another gives the same tokens, not the same last bits."""
    if isinstance(want, float):
        return isinstance(got, float) and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-5)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    return got == want


def _folded(events: list) -> dict:
    """A stream's chunks folded per choice (text, token ids, logprobs, finish reason): chunking is timing, not content."""
    choices: dict = {}
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            into = choices.setdefault(choice["index"], {"text": "", "token_ids": [], "logprobs": {},
                                                        "finish_reason": None})
            into["text"] += choice["text"]
            into["token_ids"] += choice.get("token_ids") or []
            for key, values in (choice.get("logprobs") or {}).items():
                into["logprobs"][key] = into["logprobs"].get(key, []) + values
            into["finish_reason"] = choice["finish_reason"] or into["finish_reason"]
    return choices


def _shifted(prompt: list) -> list:
    """The same shape of prompt with other token ids (a list of prompts stays a list of prompts)."""
    if prompt and isinstance(prompt[0], list):
        return [_shifted(p) for p in prompt]
    return [token + 50 for token in prompt]


def _stream(url: str, body: dict, timeout_s: float = BOUND_S) -> list:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=timeout_s) as response:
        assert response.status_code == 200
        return _events(response)


REQUESTS = [
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "return_token_ids": True}),
    # One alternative: the sampled token. More would compare near-ties of a random model's flat distribution,
    # which the last bits of a matmul (another thread count, a prefix-cache hit) can reorder.
    ("/v1/completions", {"prompt": list(range(20, 45)), "max_tokens": 9, "temperature": 0, "ignore_eos": True,
                         "logprobs": 1}),
    ("/v1/completions", {"prompt": [[9, 10, 11], [12, 13]], "max_tokens": 5, "temperature": 0, "n": 2,
                         "return_token_ids": True}),
]


@pytest.mark.parametrize("prefix", ["", f"/{SCALING_APP}"], ids=["engine-threads", "loop-ingress-and-replica"])
def test_completions_and_streams_equal_pagedkv_serve(app, local, prefix):
    for path, body in REQUESTS:
        plain = httpx.post(app.url + prefix + path, json={**body, "model": MODEL}, timeout=BOUND_S)
        want = local.post(path, json={**body, "model": MODEL})
        assert plain.status_code == want.status_code == 200
        assert _same(_comparable(plain.json()), _comparable(want.json()))
        # The stream gets prompts of its own: a prefix-cache hit takes another path through the kernels (one
        # side could hit where the other misses), and this compares answers, not cache placement.
        body = {**body, "prompt": _shifted(body["prompt"])}
        streamed = _stream(app.url + prefix + path, body)
        with local.stream("POST", path, json={**body, "stream": True}) as response:
            wanted = _events(response)
        assert streamed[-1] == wanted[-1] == "[DONE]"
        assert _same(_folded(streamed), _folded(wanted))
        assert all(c["finish_reason"] for c in _folded(streamed).values())
    assert httpx.get(app.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL


BAD = [
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": -1}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "frobnicate": 1}),
    ("/v1/completions", {"max_tokens": 4}),
    ("/v1/completions", {"prompt": [5, 100000], "max_tokens": 4}),  # a token id past the vocabulary
    ("/v1/completions", {"prompt": list(range(1, 600)), "max_tokens": 4}),  # longer than max_model_len
    ("/v1/completions", {"prompt": "text", "max_tokens": 4}),  # a model without a tokenizer
    ("/v1/chat/completions", {"messages": "not a list"}),
]


def test_bad_input_gets_the_same_4xx_as_pagedkv_serve(app, local):
    for path, body in BAD:
        got = httpx.post(app.url + path, json=body, timeout=BOUND_S)
        want = local.post(path, json=body)
        assert 400 <= want.status_code < 500, body
        assert (got.status_code, got.json()) == (want.status_code, want.json()), body
    raw = httpx.post(app.url + "/v1/completions", content=b"{not json", timeout=BOUND_S,
                     headers={"content-type": "application/json"})
    want = local.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert (raw.status_code, raw.json()) == (want.status_code, want.json()) and raw.status_code == 400


def test_health_reports_each_replica(app):
    health = httpx.get(app.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert sorted(r["replica"] for r in health["replicas"]) == sorted(r["replica_id"] for r in running())
    assert len({r["node"] for r in health["replicas"]}) == 2  # one replica on each node


def test_requests_go_in_by_lanes_once_the_ingress_has_one_to_each_replica(app):
    def lanes() -> list:
        return httpx.get(app.url + "/health", timeout=10).json()["replicas"]

    wait_for(lambda: all(r["lane"] for r in lanes()) and len(lanes()) == 2, "a lane to each replica")
    before = sum(r["lane_requests"] for r in lanes())
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
    answers = [httpx.post(app.url + "/v1/completions", json=body, timeout=BOUND_S) for _ in range(4)]
    assert all(answer.status_code == 200 for answer in answers)
    assert len({answer.json()["choices"][0]["text"] for answer in answers}) == 1
    assert sum(r["lane_requests"] for r in lanes()) - before == 4


def test_shared_prefix_requests_go_to_the_replica_that_holds_it(app):
    system = list(range(100, 132))  # 8 blocks of 4 tokens
    before = replica_stats()
    first = httpx.post(app.url + "/v1/completions", json={"prompt": system + [7], "max_tokens": 2}, timeout=BOUND_S)
    assert first.status_code == 200
    after_first = replica_stats()
    holder = [key for key in before if num_started(after_first[key]) > num_started(before[key])]
    assert len(holder) == 1
    for suffix in range(8):
        body = {"prompt": system + [200 + suffix, 300 + suffix], "max_tokens": 2}
        assert httpx.post(app.url + "/v1/completions", json=body, timeout=BOUND_S).status_code == 200
    after = replica_stats()
    served = {key: num_started(after[key]) - num_started(after_first[key]) for key in after}
    assert served[holder[0]] == 8 and sum(served.values()) == 8


def test_a_disconnected_stream_is_aborted_and_its_blocks_freed(app):
    body = {"prompt": list(range(40, 60)), "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=BOUND_S) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
    # The client has gone: within the bound, no replica runs anything and every block is free again.
    wait_for(lambda: all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == 256
                         for s in replica_stats().values()), "the aborted request's blocks to come back")
    # And the engines' own accounting agrees (asked in each engine process: the router spreads these calls).
    engines = serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP)
    assert [engines.check_integrity.remote().result(timeout_s=30) for _ in range(4)] == [0] * 4


def _stream_to_end(url: str, body: dict, results: list, index: int) -> None:
    start = time.monotonic()
    try:
        events = _stream(url, body)
        results[index] = (events, time.monotonic() - start)
    except Exception as error:  # noqa: BLE001 - the test reports it
        results[index] = (error, time.monotonic() - start)


def _is_running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie waiting to be reaped has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killing_a_replica_mid_stream_ends_every_stream_and_the_restart_serves(app):
    body = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    results: list = [None] * 6
    threads = [threading.Thread(target=_stream_to_end, args=(app.url + "/v1/completions",
                                                              {**body, "prompt": [11 + i, 12, 13, 14, 15]}, results, i))
               for i in range(len(results))]
    for thread in threads:
        thread.start()
    busy = wait_for(lambda: [key for key, s in replica_stats().items() if s["num_running"] > 0], "the streams to start")
    victim = next(r for r in running() if r["replica_id"] == busy[0])
    actor = ray.get_actor(victim["actor_name"], namespace=SERVE_NAMESPACE)
    engine_pid = replica_stats()[victim["replica_id"]]["engine_pid"]
    assert _is_running(engine_pid)
    before = {r["replica_id"] for r in running()}
    time.sleep(0.5)  # its streams are under way: the client has tokens
    ray.kill(actor, no_restart=True)
    for thread in threads:
        thread.join(BOUND_S)
    assert not any(thread.is_alive() for thread in threads)  # nobody hangs
    num_failed = 0
    for events, seconds in results:
        assert isinstance(events, list), events
        assert events[-1] == "[DONE]" and seconds < BOUND_S
        last = json.loads(events[-2])
        if "error" in last:  # an error event, then [DONE]
            num_failed += 1
            assert last["error"]["type"] == "server_error"
        else:  # or the full answer
            assert sum(len(json.loads(e)["choices"][0].get("token_ids") or []) for e in events[:-1]) == 400
    assert num_failed >= 1  # the victim's streams ended with an error event
    wait_for(lambda: not _is_running(engine_pid), "the killed replica's engine process to exit", BOUND_S)
    # Ray starts a new replica in the victim's place, and the router sends it requests.
    wait_for(lambda: len(running()) == 2 and victim["replica_id"] not in {r["replica_id"] for r in running()},
             "the replica to restart")
    new = {r["replica_id"] for r in running()} - before

    def new_replica_served() -> bool:
        burst = [threading.Thread(target=httpx.post, args=(app.url + "/v1/completions",),
                                  kwargs={"json": {"prompt": [400 + i, 5, 6], "max_tokens": 16}, "timeout": BOUND_S})
                 for i in range(6)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(BOUND_S)
        stats = replica_stats()
        return all(num_started(stats.get(key, {"num_started": {}})) > 0 for key in new)

    wait_for(new_replica_served, "the restarted replica to take traffic")
    assert len(httpx.get(app.url + "/health", timeout=10).json()["replicas"]) == 2


def test_removing_a_node_leaves_the_other_replica_serving(app):
    worker_node = app.worker.node_id
    on_worker = [r for r in running() if r["node_id"] == worker_node]
    assert len(on_worker) == 1
    app.cluster.remove_node(app.worker)
    body = {"prompt": [21, 22, 23, 24, 25], "max_tokens": 8, "temperature": 0}
    for _ in range(6):  # every request is answered, by the replica left
        assert httpx.post(app.url + "/v1/completions", json=body, timeout=BOUND_S).status_code == 200
    wait_for(lambda: on_worker[0]["replica_id"] not in {r["replica_id"] for r in running()},
             "the lost replica to leave the running set")
    health = httpx.get(app.url + "/health", timeout=10).json()
    assert health["status"] in ("ok", "degraded") and any(r["alive"] for r in health["replicas"])
    # Its replacement waits for a node with room (the kill test above shows a replacement taking traffic).


def test_autoscaling_goes_up_on_a_burst_and_down_when_idle(app):
    url = f"{app.url}/{SCALING_APP}/v1/completions"
    wait_for(lambda: len(replicas(SCALING_APP)) == 1 and running(SCALING_APP), "the idle app at 1 replica")
    results: list = [None] * 8
    threads = [threading.Thread(target=_stream_to_end, args=(url, {"prompt": [30 + i, 31, 32], "max_tokens": 200,
                                                                   "ignore_eos": True}, results, i))
               for i in range(len(results))]
    for thread in threads:
        thread.start()
    # The autoscaler adds a replica (it then warms up: loads the model, sizes its pool) ...
    wait_for(lambda: len(replicas(SCALING_APP)) == 2, "the burst to scale the app up to 2")
    for thread in threads:
        thread.join(BOUND_S)
    for events, _ in results:
        assert isinstance(events, list) and events[-1] == "[DONE]" and "error" not in events[-2], events
    # ... and removes it once the app has been idle for downscale_delay_s.
    wait_for(lambda: len(replicas(SCALING_APP)) == 1, "the idle app to scale back down to 1")
