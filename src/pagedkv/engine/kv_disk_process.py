"""The disk tier's writes in a child process, over a host pool in shared memory (`kv_offload_disk_writer="process"`).

Writer threads (`kv_disk.DiskStore`) take the interpreter lock several times per block, and
each time they take it while the step loop runs Python, the loop waits: on a 2-core machine a
Python loop beside four threads writing 1.8 MB blocks ran 1.25-1.28x slower, beside one writer
process 0.96-1.00x. Here the host pool lives in shared memory (`SharedHostPool`; registered
with CUDA as pinned memory, so the copies into it stay asynchronous) and one child process
(a fresh interpreter running this module: it imports no torch and holds no CUDA context) hashes and writes the blocks:

    engine process                                   writer process
    write_async(key, block, ready_event)  -- FIFO -->  ("write", key, block, token)
      sent once the copy filling the block is done     sha256, write temp file, rename
    poll / a wait for a write             <-- pipe --  ("done", token, ok)

Commands leave in order (a delete never overtakes the write of its key) and only once the
device copy that fills their block has finished (`torch.cuda.Event.query`, checked at every
poll, so the step loop never blocks on it; a wait for one write synchronizes its event). The
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
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

from pagedkv.engine.kv_disk import DiskStore

logger = logging.getLogger("pagedkv")

#: Where `SharedMemory` puts its segments (Linux); the host pool must fit in what it has free.
SHM_DIR = "/dev/shm"


class SharedHostPool:
    """`nbytes` of shared memory, as a torch uint8 tensor; pinned (cudaHostRegister) when `pin` is set."""

    def __init__(self, shm: SharedMemory, nbytes: int, pin: bool):
        import torch

        self.shm = shm
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
        self.pinned = False
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
        """Unpin and free the segment (idempotent)."""
        if self.shm is None:
            return
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        shm, self.shm = self.shm, None
        with contextlib.suppress(BufferError):
            shm.close()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


class _Done:
    """A write's done flag, set when the writer process reports it; `wait` pumps the pipe until then."""

    __slots__ = ("_store", "_set")

    def __init__(self, store: ProcessDiskStore):
        self._store = store
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout=None) -> bool:
        if not self._set:
            self._store._pump(until=self)
        return True


class ProcessDiskStore(DiskStore):
    """A `DiskStore` whose writes and deletes run in one writer process over `pool` (a `SharedHostPool` of
    `block_nbytes`-byte blocks). `write_async` takes the block's index and the CUDA event after which it may
    be read; reads and the synchronous `write` (a shutdown's persist) run in this process as before."""

    takes_blocks = True

    def __init__(self, root, fingerprint_hex: str, block_nbytes: int, pool: SharedHostPool):
        self._pool = pool
        self._pending: list[tuple] = []  # commands not sent yet, in order: (event or None, message, done or None)
        self._inflight: dict[int, tuple[bytes, _Done]] = {}  # token -> (key, done) sent, not reported
        self._next_token = 0
        self._pump_lock = threading.RLock()
        self._process = None
        super().__init__(root, fingerprint_hex, block_nbytes, num_write_threads=0)

    def _start_writers(self, num_write_threads: int) -> None:
        # A fresh interpreter running this module (not multiprocessing's spawn, which would import the
        # user's main module again); two pipes carry pickled commands in and reports out.
        commands_in, commands_out = os.pipe()
        results_in, results_out = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(commands_in), str(results_out), self._pool.shm.name,
             str(self._pool.nbytes), str(self.block_nbytes), str(self.dir.parent), self.dir.name],
            pass_fds=(commands_in, results_out), stdin=subprocess.DEVNULL, close_fds=True)
        os.close(commands_in)
        os.close(results_out)
        self._commands_out = Connection(commands_out, readable=False)
        self._results_in = Connection(results_in, writable=False)
        self._threads = []

    # ------------------------------------------------------------------ writes
    def write_async(self, key: bytes, data, ready=None, *, block: int | None = None) -> _Done:
        """Queue writing host block `block` as `key`'s file once `ready` (a CUDA event, or None) has completed."""
        if block is None:
            raise ValueError("the writer process writes host blocks: pass block=")
        done = _Done(self)
        with self._lock:
            self._queued[key] = done
        with self._pump_lock:
            self._pending.append((ready, ("write", key, block), done))
            self._send_ready()
        return done

    def delete_async(self, key: bytes) -> None:
        with self._pump_lock:
            self._pending.append((None, ("delete", key), None))
            self._send_ready()

    def _send_ready(self, through: int = 0) -> None:
        """Send the pending commands from the front: the first `through` of them whatever it takes (their copies
        waited for), then those whose copies are done. Holds the pump lock."""
        while self._pending:
            event, message, done = self._pending[0]
            if event is not None and not event.query():
                if through <= 0:
                    return
                event.synchronize()
            self._pending.pop(0)
            through -= 1
            if message[0] == "write":
                token = self._next_token
                self._next_token += 1
                self._inflight[token] = (message[1], done)
                message = (*message, token)
            self._commands_out.send(message)

    def _pump(self, until: _Done | None = None, flush_token=None) -> None:
        """Send what is ready and take the writer's reports; block until `until` is set or `flush_token` returns."""
        with self._pump_lock:
            if until is not None and not until._set:
                position = next((i for i, (_, _, done) in enumerate(self._pending) if done is until), -1)
                self._send_ready(through=position + 1)
            while True:
                waiting = (until is not None and not until._set) or flush_token is not None
                if not waiting and not self._results_in.poll():
                    return
                report = self._results_in.recv()
                if report[0] == "done":
                    _, token, ok = report
                    key, done = self._inflight.pop(token)
                    self._finish(key, done, ok)
                elif report[0] == "flushed":
                    if report[1] == flush_token:
                        flush_token = None
                elif report[0] == "disabled":
                    self._disable(report[1])

    def _finish(self, key: bytes, done: _Done, ok: bool) -> None:
        with self._lock:
            if self._queued.get(key) is done:
                del self._queued[key]
            self._results.append((key, ok))
        done._set = True

    def poll(self) -> list[tuple[bytes, bool]]:
        self._pump()
        return super().poll()

    def flush(self) -> None:
        """Send every pending command (waiting for their copies) and wait until the writer has done them all."""
        with self._pump_lock:
            if self._process is None:
                return
            self._send_ready(through=len(self._pending))
            token = self._next_token
            self._next_token += 1
            self._commands_out.send(("flush", token))
            self._pump(flush_token=token)

    def close(self) -> None:
        """Finish the queued work and stop the writer process (idempotent)."""
        if self._process is None:
            return
        self.flush()
        self._commands_out.send(None)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._process = None
        self._commands_out.close()
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
    """The writer process: write and delete block files as `commands` say, reporting on `results`."""
    import numpy as np

    shm = SharedMemory(name=shm_name)
    try:
        from multiprocessing import resource_tracker  # the engine process owns (and unlinks) the segment
        resource_tracker.unregister(shm._name, "shared_memory")
    except Exception:  # noqa: BLE001 - only a leak warning at exit is at stake
        pass
    pool = np.ndarray((nbytes // block_nbytes, block_nbytes), dtype=np.uint8, buffer=shm.buf)
    store = DiskStore(root, fingerprint_hex, block_nbytes, num_write_threads=0)
    reported = None
    try:
        while True:
            try:
                message = commands.recv()
            except EOFError:  # the engine process is gone
                return
            if message is None:
                return
            if store.disabled_reason is not None and reported is None:
                reported = store.disabled_reason
                results.send(("disabled", reported))
            kind = message[0]
            if kind == "write":
                _, key, block, token = message
                ok = store.write(key, pool[block])
                if store.disabled_reason is not None and reported is None:
                    reported = store.disabled_reason
                    results.send(("disabled", reported))
                results.send(("done", token, ok))
            elif kind == "delete":
                with contextlib.suppress(OSError):
                    store.path(message[1]).unlink(missing_ok=True)
            elif kind == "flush":
                results.send(("flushed", message[1]))
    finally:
        del pool
        shm.close()


if __name__ == "__main__":
    _in, _out, _name, _nbytes, _block, _root, _fingerprint = sys.argv[1:8]
    writer_main(Connection(int(_in), writable=False), Connection(int(_out), readable=False), _name, int(_nbytes),
                int(_block), _root, _fingerprint)
