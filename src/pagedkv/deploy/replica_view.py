"""`ReplicaView`: what the Ray ingress's engine client knows of the engine deployment's replicas.

The Serve controller's list of replicas (polled every `REPLICA_POLL_S` in the background, so a
/health request never waits on Ray), and each replica's queues and stats as its latest output
carried them. `RayEngineClient` reports from it: `/health` per replica, and the queue sizes and
stats that /metrics sums over the live ones.
"""

from __future__ import annotations

import asyncio
import logging

from pagedkv.distributed.replica_process import ReplicaStatsSum
from pagedkv.engine.client import QueueSizes

logger = logging.getLogger("pagedkv.deploy")

REPLICA_POLL_S = 1.0


def replica_state(replica: dict) -> str | None:
    """A replica's state ("RUNNING", ...) in the Serve controller's list."""
    state = replica.get("state")
    return getattr(state, "value", state)


class ReplicaView:
    """The mixin's state, which the client fills: `_replicas` (the controller's list), `_loads` and `_stats`
    (replica id -> `Load` / stats dict, from outputs), `_app_name` and `_deployment_name`."""

    _replicas: list[dict]
    _loads: dict
    _stats: dict[str, dict]
    _app_name: str
    _deployment_name: str

    async def _watch_replicas(self) -> None:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = None
        while ray.is_initialized():  # in an ingress replica; a client outside Ray (a unit test) has no controller
            try:
                if controller is None:
                    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
                details = await controller.get_serve_instance_details.remote()
                app = details["applications"][self._app_name]
                self._replicas = app["deployments"][self._deployment_name]["replicas"]
                self._replicas_changed()
            except Exception as error:  # noqa: BLE001 - /health shows the last snapshot; try again later
                logger.debug("reading the replica list failed: %s", error)
                controller = None
            await asyncio.sleep(REPLICA_POLL_S)

    def _replicas_changed(self) -> None:
        """Called after each poll of the list (on the watcher's loop)."""

    def health(self) -> list[dict]:
        """Per replica (as the Serve controller last reported them): id, node, state, alive, queues."""
        report = []
        for replica in list(self._replicas):
            key = replica["replica_id"]
            load = self._loads.get(key)
            state = replica_state(replica)
            report.append({"replica": key, "node": replica.get("node_id"), "state": state, "alive": state == "RUNNING",
                           "waiting": load.num_waiting if load else 0, "running": load.num_running if load else 0,
                           "free_blocks": load.num_free_blocks if load else 0,
                           "lane": key in getattr(self, "_lanes", ()),
                           "lane_requests": getattr(self, "_num_lane_sent", {}).get(key, 0)})
        return report

    def _live_keys(self) -> set[str]:
        return {r["replica_id"] for r in self._replicas} or set(self._stats) | set(self._loads)

    def queue_sizes(self) -> QueueSizes:
        """Requests waiting and running, summed over live replicas as their latest outputs reported them."""
        live = self._live_keys()
        loads = [load for key, load in list(self._loads.items()) if key in live]
        return QueueSizes(sum(x.num_waiting for x in loads), sum(x.num_running for x in loads), 0)

    def latest_stats(self):
        """The live replicas' stats as their outputs last carried them, summed (`ReplicaStatsSum`)."""
        live = self._live_keys()
        per_replica = [stats for key, stats in list(self._stats.items()) if key in live]
        return ReplicaStatsSum(per_replica or list(self._stats.values())[-1:])

    def check_integrity(self) -> None:
        """Each replica's engine checks its own blocks; nothing is shared to check here."""

