"""Writes pickled messages to a replica pipe in order, and never blocks the thread that sends them.

Both ends of a data-parallel replica's pipe (the parent and the replica process) write through a
`PipeWriter`. Most messages go out at once from the caller's thread: when nothing is queued
before it, the message is small (`INLINE_MAX_BYTES`, and at most a quarter of the socket's send
buffer) and the socket has room (a Unix stream socket polls writable only while at most a quarter
of its send buffer is in use, so a write that small then never waits). Any other message goes to
a writer thread, in order behind what it already holds: so a side whose peer is not reading (a
replica in a long step, a parent busy routing a burst) is never stuck on its own write while the
peer is stuck on its.

Why not always the thread: the replica's engine loop holds the interpreter lock for most of a
step, and a writer thread woken to send the step's outputs waits for it, up to the interpreter's
switch interval (5 ms); every streamed token paid that wait on its way to the parent, the
first token of a request (its TTFT) included.
"""

from __future__ import annotations

import queue
import select
import socket
import threading

#: A message at most this large may be written from the caller's thread.
INLINE_MAX_BYTES = 32 << 10


def inline_limit(conn) -> int:
    """The largest message `conn` takes from the caller's thread: 0 for a pipe that is not a Unix socket."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except OSError:
        return 0
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            return 0
        return min(INLINE_MAX_BYTES, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4)
    except OSError:
        return 0
    finally:
        sock.detach()  # the descriptor stays the connection's


class PipeWriter:
    """`send(blob)` writes `blob` to `conn` (`Connection.send_bytes`) after every blob sent before it.

    `close()` lets the writer thread finish what it holds and end; `join()` waits for that. A peer
    gone (a broken pipe) makes later sends no-ops, as a dead peer reads nothing.
    """

    def __init__(self, conn, name: str):
        self._conn = conn
        self._limit = inline_limit(conn)
        self._poll = select.poll()
        if self._limit:
            self._poll.register(conn.fileno(), select.POLLOUT)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._write_lock = threading.Lock()  # held by whoever is writing to conn
        self._count_lock = threading.Lock()  # guards _queued only; never held while writing
        self._queued = 0  # blobs handed to the thread and not yet written
        self._broken = False
        self.num_inline = 0  # blobs written from the caller's thread (a figure for tests and profiles)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, blob: bytes) -> None:
        if self._broken:
            return
        if len(blob) <= self._limit and self._write_lock.acquire(blocking=False):
            try:
                with self._count_lock:
                    clear = self._queued == 0
                if clear and self._poll.poll(0):
                    self._write(blob)
                    self.num_inline += 1
                    return
            finally:
                self._write_lock.release()
        with self._count_lock:
            self._queued += 1
        self._queue.put(blob)

    def close(self) -> None:
        """No more sends: the thread writes what it holds, then ends."""
        self._queue.put(None)

    def is_alive(self) -> bool:
        """Whether the writer still writes: its thread runs and its peer has not gone."""
        return self._thread.is_alive() and not self._broken

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _write(self, blob: bytes) -> None:
        try:
            self._conn.send_bytes(blob)
        except (OSError, EOFError, ValueError):
            self._broken = True

    def _run(self) -> None:
        while (blob := self._queue.get()) is not None:
            if not self._broken:
                with self._write_lock:
                    self._write(blob)
            with self._count_lock:
                self._queued -= 1
