"""The disk tier's writes in a child process, over a host pool in shared memory (`kv_offload_disk_writer="process"`).

Writer threads (`kv_disk.DiskStore`) take the interpreter lock several times per block, and
each time they take it while the step loop runs Python, the loop waits: on a 2-core machine a
Python loop beside four threads writing 1.8 MB blocks ran 1.25-1.28x slower, beside one writer
process 0.96-1.00x. Here the host pool lives in shared memory (`SharedHostPool`; registered
with CUDA as pinned memory, so the copies into it stay asynchronous) and one child process
(a fresh interpreter running this module: it imports no torch and holds no CUDA context) hashes and writes the
blocks on `NUM_WRITE_THREADS` threads of its own (one thread alone fell behind the spills on an H200, and the
engine's sends then blocked on a full pipe: 0.30x of GPU-only throughput, a 354 ms step):

    engine process                                   writer process
    write_async(key, block, ready_event)  -- FIFO -->  ("write", key, block, token)
      sent once the copy filling the block is done     sha256, write temp file, rename
    poll / a wait for a write             <-- pipe --  ("done", token, ok)

Commands leave in order (a delete never overtakes the write of its key) and only once the
device copy that fills their block has finished (`torch.cuda.Event.query`, checked at every
poll, so the step loop never blocks on it; a wait for one write synchronizes its event), and a
sender thread writes them to the pipe, so a writer that falls behind never blocks a step. The
pipes are the only traffic: no thread of the engine process touches a block's bytes. Reads stay
on the engine's reader threads (`kv_disk_io`), which share the pipe through a lock when a read
must wait for a queued write of its key. A full disk or a directory that cannot be written
turns the tier off with one warning, as the threads do.

`SharedHostPool.create` returns None (and the engine keeps the writer threads, with a log line)
where /dev/shm cannot hold the host pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import weakref
import zlib
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

from pagedkv.engine.kv_disk import NUM_WRITE_THREADS, DiskStore

logger = logging.getLogger("pagedkv")

#: Where `SharedMemory` puts its segments (Linux); the host pool must fit in what it has free.
SHM_DIR = "/dev/shm"


class SharedHostPool:
    """`nbytes` of shared memory, as a torch uint8 tensor; pinned (cudaHostRegister) when `pin` is set."""

    def __init__(self, shm: SharedMemory, nbytes: int, pin: bool):
        import torch

        self.shm = shm
        self.nbytes = nbytes
        self._state = {"unlinked": False}
        self.tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
        self.pinned = False
        # An engine dropped without its shutdown still removes the segment's name (the memory goes with the
        # process's last reference to it).
        weakref.finalize(self, _unlink_quietly, shm.name, self._state)
        if pin:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            except Exception as error:  # noqa: BLE001 - any failure to pin means: no shared pool
                self.close()
                raise RuntimeError(f"cudaHostRegister of {nbytes} shared bytes failed ({error})") from error
            self.pinned = True

    @classmethod
    def create(cls, nbytes: int, pin: bool) -> tuple[SharedHostPool | None, str | None]:
        """(the pool, None), or (None, why not): /dev/shm too small, or shared memory or pinning unavailable."""
        try:
            stat = os.statvfs(SHM_DIR)
            free = stat.f_bavail * stat.f_frsize
            if free < nbytes:
                return None, f"{SHM_DIR} has {free / 2**30:.1f} GiB free for a {nbytes / 2**30:.1f} GiB host pool"
        except OSError:
            pass  # no /dev/shm to ask (not Linux): let SharedMemory try
        try:
            shm = SharedMemory(create=True, size=max(1, nbytes))
        except OSError as error:
            return None, f"shared memory of {nbytes} bytes failed ({error})"
        try:
            return cls(shm, nbytes, pin), None
        except RuntimeError as error:
            return None, str(error)

    def close(self) -> None:
        """Unpin the segment and remove its name (idempotent). The caller has synchronized the device (no copy
        into or out of it in flight). The mapping itself goes when the last reference to this pool does, so a
        tensor view still held somewhere never points at unmapped memory while this object lives."""
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self._unlink()

    def _unlink(self) -> None:
        if not self._state["unlinked"]:
            self._state["unlinked"] = True
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


def _unlink_quietly(name: str, state: dict) -> None:
    from multiprocessing import resource_tracker

    if state["unlinked"]:
        return
    state["unlinked"] = True
    with contextlib.suppress(FileNotFoundError, OSError):
        os.unlink(os.path.join(SHM_DIR, name.lstrip("/")))
    with contextlib.suppress(Exception):
        resource_tracker.unregister(f"/{name.lstrip('/')}", "shared_memory")


class _Done(threading.Event):
    """A write's done flag, set when the writer process reports it (or when it died); waiting for it first sends
    its command, waiting out the device copy that fills its block if need be."""

    def __init__(self, store: ProcessDiskStore):
        super().__init__()
        self._store = store

    def wait(self, timeout=None) -> bool:
        if not self.is_set():
            self._store._send_through(self)
        return super().wait(timeout)


class ProcessDiskStore(DiskStore):
    """A `DiskStore` whose writes and deletes run in one writer process over `pool` (a `SharedHostPool` of
    `block_nbytes`-byte blocks). `write_async` takes the block's index and the CUDA event after which it may
    be read; reads and the synchronous `write` (a shutdown's persist) run in this process as before.

    A thread of this process reads the writer's reports (so neither pipe ever fills while the other waits,
    and a read waiting for a write holds nothing the step loop needs). A writer process that dies turns the
    disk tier off: its writes report failed, later ones fail at once, and serving goes on.
    """

    takes_blocks = True
    #: Seconds the writer process has to say it is ready before the engine keeps the writer threads.
    START_TIMEOUT_S = 60.0

    def __init__(self, root, fingerprint_hex: str, block_nbytes: int, pool: SharedHostPool):
        self._pool = pool
        self._pending: deque[tuple] = deque()  # commands not sent yet, in order: (event or None, message, done or None)
        self._inflight: dict[int, tuple[bytes, _Done]] = {}  # token -> (key, done) sent, not reported
        self._next_token = 0
        self._send_lock = threading.RLock()  # the command pipe, the pending list and the tokens
        self._flushed: dict[int, threading.Event] = {}
        self._dead: str | None = None  # why the writer process is gone
        self._process = None
        # Commands ready to go, in order; the sender thread writes them to the pipe, so a writer process that has
        # fallen behind (its pipe full) never blocks the step loop.
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        super().__init__(root, fingerprint_hex, block_nbytes, num_write_threads=0)

    def _start_writers(self, num_write_threads: int) -> None:
        # A fresh interpreter running this module (not multiprocessing's spawn, which would import the
        # user's main module again); two pipes carry pickled commands in and reports out.
        commands_in, commands_out = os.pipe()
        results_in, results_out = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(commands_in), str(results_out), self._pool.shm.name,
             str(self._pool.nbytes), str(self.block_nbytes), str(self.dir.parent), self.dir.name],
            pass_fds=(commands_in, results_out), stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        os.close(commands_in)
        os.close(results_out)
        self._commands_out = Connection(commands_out, readable=False)
        self._results_in = Connection(results_in, writable=False)
        self._threads = []
        try:
            ready = self._results_in.poll(self.START_TIMEOUT_S) and self._results_in.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._stop_process()
            raise RuntimeError(f"the disk writer process did not start (exit status {self._process_status()})")
        self._reader = threading.Thread(target=self._read_reports, name="pagedkv-kv-disk-reports", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_commands, name="pagedkv-kv-disk-commands", daemon=True)
        self._sender.start()

    def _send_commands(self) -> None:
        """On the sender thread: write the queued commands to the pipe in order, until the stop (None)."""
        while True:
            message = self._outgoing.get()
            try:
                self._commands_out.send(message)
            except (OSError, EOFError) as error:  # the writer process is gone
                self._died(f"the disk writer process is gone ({error})")
                return
            if message is None:
                return

    def _process_status(self):
        return self._process.poll() if self._process is not None else None

    # ------------------------------------------------------------------ writes
    def write_async(self, key: bytes, data, ready=None, *, block: int | None = None) -> _Done:
        """Queue writing host block `block` as `key`'s file once `ready` (a CUDA event, or None) has completed."""
        if block is None:
            raise ValueError("the writer process writes host blocks: pass block=")
        done = _Done(self)
        with self._lock:
            self._queued[key] = done
        with self._send_lock:
            if self._dead is not None:
                self._finish(key, done, False)
                return done
            self._pending.append((ready, ("write", key, block), done))
            self._send_ready()
        return done

    def delete_async(self, key: bytes) -> None:
        with self._send_lock:
            if self._dead is None:
                self._pending.append((None, ("delete", key), None))
                self._send_ready()

    def _send_ready(self, through: int = 0) -> None:
        """Queue the pending commands for the sender thread from the front: the first `through` of them whatever it
        takes (their copies waited for), then those whose copies are done. Holds the send lock."""
        while self._pending and self._dead is None:
            event, message, done = self._pending[0]
            if event is not None and not event.query():
                if through <= 0:
                    return
                event.synchronize()
            self._pending.popleft()
            through -= 1
            if message[0] == "write":
                token = self._next_token
                self._next_token += 1
                self._inflight[token] = (message[1], done)
                message = (*message, token)
            self._outgoing.put(message)

    def _send_through(self, done: _Done) -> None:
        """Send the commands up to `done`'s (a wait needs its write under way)."""
        with self._send_lock:
            position = next((i for i, (_, _, pending) in enumerate(self._pending) if pending is done), -1)
            if position >= 0:
                self._send_ready(through=position + 1)

    def _read_reports(self) -> None:
        """On the reports thread: mark writes done as the writer process reports them, until it exits."""
        while True:
            try:
                report = self._results_in.recv()
            except (EOFError, OSError):
                if self._process is not None:  # not a close: it died
                    self._died(f"the disk writer process exited (status {self._process_status()})")
                return
            if report[0] == "done":
                _, token, ok = report
                with self._send_lock:
                    key, done = self._inflight.pop(token)
                self._finish(key, done, ok)
            elif report[0] == "flushed":
                self._flushed.pop(report[1]).set()
            elif report[0] == "disabled":
                self._disable(report[1])

    def _died(self, reason: str) -> None:
        """The writer process is gone: every write not reported failed, later ones fail at once, the tier is off."""
        with self._send_lock:
            if self._dead is not None:
                return
            self._dead = reason
            unreported = list(self._inflight.values()) + [(message[1], done) for _, message, done in self._pending
                                                          if done is not None]
            self._inflight.clear()
            self._pending.clear()
            flushes = list(self._flushed.values())
            self._flushed.clear()
        for key, done in unreported:
            self._finish(key, done, False)
        for flushed in flushes:
            flushed.set()
        self._disable(reason)

    def _finish(self, key: bytes, done: _Done, ok: bool) -> None:
        with self._lock:
            if self._queued.get(key) is done:
                del self._queued[key]
            self._results.append((key, ok))
        done.set()

    def poll(self) -> list[tuple[bytes, bool]]:
        with self._send_lock:
            self._send_ready()
        return super().poll()

    def flush(self) -> None:
        """Send every pending command (waiting for their copies) and wait until the writer has done them all."""
        with self._send_lock:
            if self._process is None or self._dead is not None:
                return
            self._send_ready(through=len(self._pending))
            token = self._next_token
            self._next_token += 1
            flushed = self._flushed[token] = threading.Event()
            self._outgoing.put(("flush", token))
        flushed.wait()

    def close(self) -> None:
        """Finish the queued work and stop the writer process (idempotent)."""
        if self._process is None:
            return
        self.flush()
        self._stop_process()
        self._reader.join(timeout=30)

    def _stop_process(self) -> None:
        process, self._process = self._process, None
        if self._sender is not None and self._sender.is_alive():
            self._outgoing.put(None)
            self._sender.join(timeout=30)
        else:
            with contextlib.suppress(OSError, EOFError):
                self._commands_out.send(None)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._commands_out.close()
        with contextlib.suppress(OSError):
            self._results_in.close()

    # The writer process never takes this process's interpreter lock: nothing to hold.
    @property
    def writes_held(self) -> bool:
        return False

    def holding_writes(self):
        return contextlib.nullcontext()

    def hold_writes(self) -> None:
        pass

    def release_writes(self) -> None:
        pass

    def writes_running(self):
        return contextlib.nullcontext()


def writer_main(commands, results, shm_name: str, nbytes: int, block_nbytes: int, root: str, fingerprint_hex: str):
    """The writer process: write and delete block files as `commands` say, reporting on `results`. It stops
    when told, or when the engine's end of the pipe closes; signals meant for the engine (Ctrl-C, a service
    manager's SIGTERM) do not stop it before the engine's shutdown has written what it persists."""
    import signal

    import numpy as np

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    shm = SharedMemory(name=shm_name)
    try:
        from multiprocessing import resource_tracker  # the engine process owns (and unlinks) the segment
        resource_tracker.unregister(shm._name, "shared_memory")
    except Exception:  # noqa: BLE001 - only a leak warning at exit is at stake
        pass
    pool = np.ndarray((nbytes // block_nbytes, block_nbytes), dtype=np.uint8, buffer=shm.buf)
    store = DiskStore(root, fingerprint_hex, block_nbytes, num_write_threads=0)
    send_lock = threading.Lock()  # the writer threads share the reports pipe
    reported: list[str] = []

    def report(message) -> None:
        with send_lock:
            if store.disabled_reason is not None and not reported:
                reported.append(store.disabled_reason)
                results.send(("disabled", store.disabled_reason))
            if message is not None:
                results.send(message)

    class Flush:
        """A flush waits for every writer thread to reach it; the last one reports it."""

        def __init__(self, token: int, count: int):
            self.token, self.count, self.lock = token, count, threading.Lock()

        def reached(self) -> None:
            with self.lock:
                self.count -= 1
                last = self.count == 0
            if last:
                report(("flushed", self.token))

    def work(jobs: queue.SimpleQueue) -> None:
        # Several threads, as the engine's own writer threads: hashing and writing release this interpreter's lock
        # (and this process shares no lock with the engine). A key's jobs all go to one thread, in order.
        while (message := jobs.get()) is not None:
            if isinstance(message, Flush):
                message.reached()
                continue
            kind = message[0]
            if kind == "write":
                _, key, block, token = message
                try:
                    ok = store.write(key, pool[block])
                except Exception as error:  # noqa: BLE001 - a write that fails is a block not cached
                    logger.warning("KV disk tier: writing %s failed: %s", key.hex(), error)
                    ok = False
                report(("done", token, ok))
            elif kind == "delete":
                with contextlib.suppress(OSError):
                    store.path(message[1]).unlink(missing_ok=True)

    queues = [queue.SimpleQueue() for _ in range(NUM_WRITE_THREADS)]
    threads = [threading.Thread(target=work, args=(jobs,), daemon=True) for jobs in queues]
    for thread in threads:
        thread.start()
    results.send(("ready",))
    try:
        while True:
            try:
                message = commands.recv()
            except EOFError:  # the engine process is gone
                return
            if message is None:
                return
            if message[0] == "flush":
                flush = Flush(message[1], len(queues))
                for jobs in queues:
                    jobs.put(flush)
            else:
                queues[zlib.crc32(message[1]) % len(queues)].put(message)
    finally:
        for jobs in queues:
            jobs.put(None)
        for thread in threads:
            thread.join()
        report(None)
        del pool
        shm.close()

if __name__ == "__main__":
    _in, _out, _name, _nbytes, _block, _root, _fingerprint = sys.argv[1:8]
    writer_main(Connection(int(_in), writable=False), Connection(int(_out), readable=False), _name, int(_nbytes),
                int(_block), _root, _fingerprint)
