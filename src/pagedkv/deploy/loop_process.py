"""`LoopProcessEngine`: a replica's engine process driven from the replica's event loop, with no engine thread.

On CUDA a Ray Serve replica runs its engine in a child process (`DataParallelEngine` with one
replica). The replica's own process then computes nothing: it forwards requests down a pipe and
outputs up it. With an engine thread in between (`AsyncEngine`), each request crossed from the
loop to that thread and each output from the thread back to the loop, two waits for the
interpreter lock per request on top of the pipe's. Here the loop does both ends itself:

    generate() ── add_request ──► PipeWriter (written at once, or by its thread when the pipe is full)
    outputs()  ◄── sink ◄── step(timeout_s=0) ◄── loop.add_reader(the pipe): runs when the child wrote

`LoopAsyncEngine` fronts it (the same bookkeeping and failure containment as the engine thread);
this class gives it the client surface it expects: `event_loop`, `attach(sink)` and the engine's
calls. Nothing here blocks the loop for long: a command never waits on the pipe, `step` with no
timeout only reads what has arrived, and the one call that waits for the child (`stats`, a round
trip of its step at most; health checks and tests) hands what it read meanwhile to the sink.

A child that dies closes its end: the pipe reads EOF, the reader is removed, and the loop looks
every `DEATH_POLL_S` until the process has exited, when `step` fails its open requests (as the
engine thread's step would have).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from pagedkv.distributed.data_parallel import DataParallelEngine

logger = logging.getLogger("pagedkv.deploy")

#: How often the loop looks whether a child whose pipe closed has exited (its requests then fail).
DEATH_POLL_S = 0.05


class LoopProcessEngine:
    """A `DataParallelEngine` of one replica, driven on `loop` (see the module docstring)."""

    def __init__(self, engine: DataParallelEngine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.event_loop = loop
        self._sink: Callable | None = None
        self._watched: set[int] = set()  # the pipes (fds) the loop reads
        self._flush_due = False

    # ------------------------------------------------------------------ LoopAsyncEngine's client surface
    def attach(self, sink: Callable) -> None:
        """Hand every output to `sink` (on the loop) from now on; start reading the pipes."""
        self._sink = sink
        for replica in self.engine.replicas:
            if not replica.closed:
                fd = replica.conn.fileno()
                self.event_loop.add_reader(fd, self._on_readable)
                # uvloop (Ray Serve's loop) makes a watched descriptor non-blocking. The pipe's reads and
                # writes frame whole messages and must block until each is done: a read cut short by EAGAIN
                # lost the message and everything after it, and a write cut short broke the pipe.
                os.set_blocking(fd, True)
                self._watched.add(fd)
        self._flush()  # anything that arrived before

    def add_request(self, request_id, token_ids, params, block_hashes=None) -> None:
        self.engine.add_request(request_id, token_ids, params, block_hashes=block_hashes)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def published_block_hashes(self) -> list:
        return self.engine.published_block_hashes()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def latest_stats(self):
        stats = self.engine.latest_stats()  # reads what the child pushed, outputs included: deliver them
        self._flush_soon()
        return stats

    def stats(self, timeout_s: float = 30.0):
        stats = self.engine.stats(timeout_s)
        self._flush_soon()
        return stats

    def check_integrity(self) -> None:
        try:
            self.engine.check_integrity()
        finally:
            self._flush_soon()

    def shutdown(self) -> None:
        self._unwatch()
        self.engine.shutdown()

    # ------------------------------------------------------------------ the pipe's side
    def _on_readable(self) -> None:
        self._flush()
        if any(replica.closed for replica in self.engine.replicas):  # EOF: the child is gone or going
            self._unwatch()
            self._watch_exit()

    def _flush(self) -> None:
        if self._sink is None:
            return
        for output in self.engine.step(timeout_s=0):
            self._sink(output)

    def _flush_soon(self) -> None:
        """Deliver, on the loop's next turn, outputs a call read from the pipe (the reader will not fire for them)."""
        if self._flush_due or self._sink is None:
            return
        self._flush_due = True

        def flush() -> None:
            self._flush_due = False
            self._flush()

        self.event_loop.call_soon_threadsafe(flush)

    def _unwatch(self) -> None:
        for fd in self._watched:
            try:
                self.event_loop.remove_reader(fd)
            except (RuntimeError, ValueError, OSError):  # the loop closed first, or the fd did
                pass
        self._watched.clear()

    def _watch_exit(self) -> None:
        """Until every closed replica's process has exited: then `step` fails its requests."""
        self._flush()
        if any(replica.closed and replica.process.is_alive() for replica in self.engine.replicas):
            self.event_loop.call_later(DEATH_POLL_S, self._watch_exit)
