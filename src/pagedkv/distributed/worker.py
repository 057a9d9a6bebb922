"""Tensor-parallel workers: ranks > 0 run every step rank 0 broadcasts, on their shard of the model.

A worker builds the same engine as rank 0 (same config, so the same pool, the same CUDA graphs,
captured in lockstep because capture runs the model's collectives) and then loops: receive a
`StepInput` (without its sampling rows: see `StepInput.for_workers`), execute it, and keep the
tokens rank 0 sampled and broadcast on the device for the next step's pending inputs. A `None`
ends the loop.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger("pagedkv")


def free_tcp_address() -> str:
    """A tcp:// address on this host with a port nobody listens on (for spawned groups)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def run_worker(engine) -> None:
    """The loop of a rank > 0 (see the module docstring); returns when rank 0 sends None."""
    tp = engine.tp
    previous = None
    while True:
        step_input = tp.broadcast_object()
        if step_input is None:
            break
        previous = engine.runner.execute(step_input, previous.device_tokens if previous is not None else None)


def worker_entry(config, rank: int, init_method: str) -> None:
    """Process entry of a spawned worker: build this rank's engine, serve steps, shut down."""
    from pagedkv.engine.engine import LLMEngine

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("PAGEDKV_HANG_DUMP_S"):  # debugging aid: print every thread's stack if still running then
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["PAGEDKV_HANG_DUMP_S"]), exit=False)
    engine = LLMEngine(config, tp_rank=rank, tp_init_method=init_method)
    try:
        run_worker(engine)
    finally:
        engine.close_group()
