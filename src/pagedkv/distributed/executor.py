"""Tensor-parallel execution: rank 0's side of the group, and the loop every other rank runs.

    rank 0 (the engine)                                   ranks 1..N-1 (workers)
    ───────────────────                                   ──────────────────────
    TensorParallelExecutor.start: spawn or join           run_worker: the same startup (model shard,
    the engine's startup, on its shard                      pool, runner, graphs in lockstep)
    send(step_input)  ── broadcast (no sampling rows) ──►   runner.execute(step_input)
    runner.execute ─► sample ── tokens, on the device ──►   kept for the next step's pending inputs
    shutdown: send None                                     the loop ends

A worker runs a model runner, never an engine: it has no scheduler, no tokenizer and no
requests. Groups are spawned here (one process per extra rank), or joined through torchrun's
environment, where every rank runs the user's script: `LLM(...)` then serves rank 0's steps on
ranks > 0 and ends the process when rank 0 shuts down (see `serve_torchrun_rank`).

A collective whose peer is gone never completes, so rank 0 watches its spawned workers: when
one dies, the watcher aborts the process group and the blocked call fails now, with the
worker's exit named, instead of at the NCCL timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time

import torch

from pagedkv.distributed.parallel import ParallelConfig, TensorParallel, all_reduce_mode_from_env, launched_by_torchrun
from pagedkv.errors import ConfigError, EngineDeadError

logger = logging.getLogger("pagedkv")


def free_tcp_address() -> str:
    """A tcp:// address on this host with a port nobody listens on (for spawned groups)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _first_device(config, device: torch.device) -> int:
    """The first GPU of the group (the engine's device, e.g. cuda:2 for a DP replica's TP group), checked."""
    size = config.tensor_parallel_size
    first = (device.index or 0) if device.type == "cuda" else 0
    if device.type == "cuda" and torch.cuda.device_count() < first + size:
        raise ConfigError(f"tensor_parallel_size {size} from cuda:{first} needs GPUs {first}..{first + size - 1}, "
                          f"but torch sees {torch.cuda.device_count()}")
    return first


def join_group(config, device: torch.device, rank: int, init_method: str, alive=None) -> TensorParallel:
    """This rank's `TensorParallel` handle (blocks until every rank has joined)."""
    parallel = ParallelConfig(config.tensor_parallel_size, rank, init_method, device.type,
                              config.distributed_timeout_s, first_device=_first_device(config, device))
    tp = TensorParallel(parallel, alive=alive)
    logger.info("tensor parallel: rank %d of %d, activations all-reduced over %s", tp.rank, tp.size,
                tp.all_reduce_mode)
    return tp


class TensorParallelExecutor:
    """Rank 0's handle on the group: starts it, sends each step to the workers, watches them, ends it."""

    def __init__(self, config, device: torch.device):
        """Spawn ranks 1..N-1 (or, under torchrun, join as rank 0) and join the group."""
        all_reduce_mode_from_env()  # a bad PAGEDKV_TP_ALL_REDUCE is refused before any process starts
        self.config = config
        self.workers: list = []
        self.worker_exit: str | None = None  # set by the watcher thread when a spawned worker dies
        self._stop_watching = threading.Event()
        self._closed = False
        _first_device(config, device)  # refuse too few GPUs before any process starts
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != config.tensor_parallel_size:
                raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes for tensor_parallel_size "
                                  f"{config.tensor_parallel_size}")
            init_method = "env://"
        else:
            init_method = free_tcp_address()
            context = torch.multiprocessing.get_context("spawn")
            for rank in range(1, config.tensor_parallel_size):
                process = context.Process(target=worker_entry, args=(config, rank, init_method), daemon=True)
                process.start()
                self.workers.append(process)
            atexit.register(self.shutdown)
        try:
            self.tp = join_group(config, device, 0, init_method,
                                 alive=self._raise_if_a_worker_died if self.workers else None)
        except BaseException:
            self._stop_workers()
            raise
        if self.workers:
            threading.Thread(target=self._watch, name="pagedkv-tp-watch", daemon=True).start()

    @property
    def device(self) -> torch.device:
        return self.tp.device

    def send(self, step_input) -> None:
        """Broadcast a step to the workers (without its sampling rows: only rank 0 samples)."""
        self.tp.broadcast_object(step_input.for_workers())

    def dead_worker(self) -> str | None:
        """How the first spawned worker that is no longer alive exited (None while all run)."""
        if self.worker_exit is not None:
            return self.worker_exit
        for process in self.workers:
            if not process.is_alive():
                return f"tensor-parallel worker process {process.pid} exited with code {process.exitcode}"
        return None

    def wait(self, result, timeout_s: float) -> str | None:
        """Wait for a step's `result`; the reason the group is broken if a worker died or it took too long."""
        deadline = time.perf_counter() + timeout_s
        while not result.ready():
            if (exit_message := self.dead_worker()) is not None:
                return exit_message
            if time.perf_counter() > deadline:
                self.tp.abort()
                return (f"a tensor-parallel step did not finish within distributed_timeout_s = {timeout_s:g} s "
                        f"(a peer stopped answering)")
            time.sleep(0.0001)
        return None

    def startup_failed(self, error: BaseException) -> EngineDeadError:
        """End the workers after the engine's startup failed; the error naming why."""
        self._stop_workers()
        return EngineDeadError(f"tensor-parallel startup failed: {self.worker_exit or error}")

    def shutdown(self, runner=None, *, broken: bool = False) -> None:
        """Tell the workers to leave (unless the group is `broken`), end them, and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)  # the registration kept the engine (and its pool) alive after shutdown
        self._stop_watching.set()  # workers leave on the None below: their exits are not failures
        if not broken and self.worker_exit is None:
            try:
                self.tp.broadcast_object(None)
            except Exception:  # noqa: BLE001 - a dead peer: nothing left to tell
                pass
        self._stop_workers(quick=broken)
        close_group(self.tp, runner)

    def _watch(self) -> None:
        """Watcher thread: when a spawned worker dies, abort the collectives so nothing waits on it forever."""
        while not self._stop_watching.wait(0.2):
            exit_message = self.dead_worker()
            if exit_message:
                self.worker_exit = exit_message
                logger.error("%s; aborting the process group", exit_message)
                self.tp.abort()
                return

    def _raise_if_a_worker_died(self) -> None:
        """`EngineDeadError` naming the exit of the first spawned worker that died (startup: nothing to fail yet)."""
        exit_message = self.dead_worker()
        if exit_message:
            raise EngineDeadError(f"{exit_message} during tensor-parallel startup")

    def _stop_workers(self, quick: bool = False) -> None:
        self._stop_watching.set()
        for process in self.workers:
            process.join(timeout=1 if quick or self.worker_exit is not None else 30)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def close_group(tp: TensorParallel, runner=None) -> None:
    """Leave the group: graphs first (they hold its communicator), then the group."""
    if runner is not None:
        runner.release_graphs()
    tp.shutdown()


def run_worker(config, rank: int, init_method: str) -> None:
    """A rank > 0: build the model runner as rank 0 builds its own, then execute its steps until None."""
    from pagedkv.engine import startup

    device = startup.pick_device(config.device)
    tp = join_group(config, device, rank, init_method)
    runner = None
    try:
        device = tp.device
        setup = startup.load_model_setup(config, device, tp, is_driver=False)
        plan = startup.plan_pool(config, setup, device, tp)
        _, runner = startup.build_runner(config, setup, plan, device, tp)
        serve_steps(tp, runner, hold_disk_writes=not config.kv_offload_disk_writes_during_steps)
    finally:
        if runner is not None and runner.offload is not None:
            runner.offload.close()  # queued KV disk-tier writes
        close_group(tp, runner)


def serve_steps(tp, runner, hold_disk_writes: bool = True) -> None:
    """Execute rank 0's steps as they are broadcast, until None.

    This rank's disk writers (if it has a disk tier) run while it waits for the next step, not while it
    launches one, as rank 0's engine does (see `pagedkv.engine.kv_disk`); `hold_disk_writes=False` lets them
    start any time."""
    io = runner.offload.io if runner.offload is not None and hold_disk_writes else None
    previous = None
    while (step_input := tp.broadcast_object()) is not None:
        with io.holding_writes() if io is not None else contextlib.nullcontext():
            previous = runner.execute(step_input, previous.device_tokens if previous is not None else None)


def worker_entry(config, rank: int, init_method: str) -> None:
    """Process entry of a spawned worker."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("PAGEDKV_HANG_DUMP_S"):  # debugging aid: print every thread's stack if still running then
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["PAGEDKV_HANG_DUMP_S"]), exit=False)
    run_worker(config, rank, init_method)


def serve_torchrun_rank(config) -> bool:
    """Under torchrun, on a rank > 0: serve rank 0's steps, then return True (the caller ends the process).

    False on rank 0 and outside torchrun: the caller builds the engine.
    """
    if config.tensor_parallel_size <= 1 or not launched_by_torchrun() or int(os.environ["RANK"]) == 0:
        return False
    if int(os.environ["WORLD_SIZE"]) != config.tensor_parallel_size:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes for tensor_parallel_size "
                          f"{config.tensor_parallel_size}")
    all_reduce_mode_from_env()
    run_worker(config, int(os.environ["RANK"]), "env://")
    return True
