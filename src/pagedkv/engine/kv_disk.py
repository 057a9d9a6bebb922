"""The disk tier's files: one file per KV block, keyed by its hash chain and the model's fingerprint.

    DIR/<fingerprint>/<key hex>.kvb      header (112 bytes) + the block's raw bytes

    header = magic "PKVBLK1\\0" | fingerprint (32) | key (32) | payload bytes (<Q) | sha256 of payload (32)

The fingerprint hashes everything that decides what a block's bytes mean: the weights, the
dtype, the KV dtype and its FP8 scales, the block size, the KV shape, the layer groups and the
tensor-parallel rank. Files of another model or config live in another directory, and a file copied across
is still refused by the fingerprint in its header. A file that is torn, truncated, flipped or
foreign is a miss with a log line, never KV.

Writes are asynchronous and atomic: a temporary file is written and then renamed over the
final name. A few writer threads share the work (hashing and writing release the interpreter
lock, and one thread hashes and writes a 2 MB block in about a millisecond, fewer blocks per
second than a busy engine spills); each key always goes to the same thread, so a key's write
and a later delete of it stay in order. The writer threads run at a lower CPU priority than the
process (Linux, `WRITER_NICENESS`): where cores are few, a step loop that shares them with four
writers slowed 2-5x on a 2-core machine at full priority, about 1.5x niced. Each write takes and
gives back the interpreter lock several times (the event wait, the hash, open, write, rename), and
each time it takes it while the step loop runs Python, the loop waits: the engine holds the writes
(`hold_writes`) while it schedules, builds and launches a step, and lets them run
(`release_writes`) while it waits for the device and between steps. A job under way finishes; any
wait for a write (`load` of a key still queued, `flush`, `close`, the engine's waits in `kv_disk_io`)
lets them run while it waits (`writes_running`), and the engine's hold resumes after it. A directory that cannot
be written, or a full disk, turns the tier off with one warning; serving goes on from GPU and host memory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from pathlib import Path

logger = logging.getLogger("pagedkv")

MAGIC = b"PKVBLK1\0"
_HEADER = struct.Struct("<8s32s32sQ32s")
SUFFIX = ".kvb"
#: Writer threads (see the module docstring).
NUM_WRITE_THREADS = min(4, os.cpu_count() or 1)
#: How much nicer than the process the writer threads run (Linux; elsewhere they run at its priority).
WRITER_NICENESS = 10
#: Errors that mean the disk tier cannot go on (as opposed to one bad file).
_FATAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM}


def fingerprint(fields: dict) -> str:
    """The hex sha256 of the sorted `fields` (weights id, dtype, KV dtype, block size, TP rank, ...)."""
    text = ";".join(f"{name}={fields[name]}" for name in sorted(fields))
    return hashlib.sha256(text.encode()).hexdigest()


class DiskStore:
    """Block files under `root/<fingerprint>/`: reads on the caller's thread, writes and deletes on writer threads."""

    def __init__(self, root: str | os.PathLike, fingerprint_hex: str, block_nbytes: int,
                 num_write_threads: int = NUM_WRITE_THREADS):
        self.fingerprint = bytes.fromhex(fingerprint_hex)
        self.block_nbytes = block_nbytes
        self.dir = Path(root) / fingerprint_hex
        self.disabled_reason: str | None = None
        self._results: list[tuple[bytes, bool]] = []  # (key, written) since the last poll
        self._queued: dict[bytes, threading.Event] = {}  # key -> done event of its write still queued
        self._lock = threading.Lock()
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(max(1, num_write_threads))]
        # Cleared while the engine holds the writes and nothing waits for one (see the module docstring).
        self._may_write = threading.Event()
        self._may_write.set()
        self._held = False  # the engine's hold
        self._num_waiting = 0  # callers waiting for a write (`writes_running`), on any thread
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            self._disable(f"the KV offload directory {self.dir} is not writable ({error.strerror or error})")
        self._start_writers(num_write_threads)

    def _start_writers(self, num_write_threads: int) -> None:
        """Start the writer threads (none: only the synchronous `write` is used, as in a writer process)."""
        self._threads = [threading.Thread(target=self._work, args=(jobs,), name=f"pagedkv-kv-disk-{index}", daemon=True)
                         for index, jobs in enumerate(self._queues)] if num_write_threads else []
        for thread in self._threads:
            thread.start()

    def _jobs(self, key: bytes) -> queue.Queue:
        """The queue of the writer thread that owns `key` (the same for every job of it)."""
        return self._queues[zlib.crc32(key) % len(self._queues)]

    def path(self, key: bytes) -> Path:
        """The file of `key`."""
        return self.dir / (key.hex() + SUFFIX)

    def scan(self) -> list[bytes]:
        """Keys with a file here, least recently written first (what a restart indexes)."""
        if not self.dir.is_dir():
            return []
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX):
                try:
                    found.append((entry.stat().st_mtime_ns, bytes.fromhex(name[:64])))
                except (OSError, ValueError):
                    continue
        return [key for _, key in sorted(found)]

    def set_order(self, keys) -> None:
        """Give the files of `keys` increasing modification times in this order (1 us apart), so that a restart's
        `scan` indexes them least recently used first as the tiers kept them: a file hit since it was written
        would otherwise count as old as its write. Missing files are passed over."""
        if self.disabled_reason is not None or not keys:
            return
        base = time.time_ns() - 1000 * len(keys)
        for index, key in enumerate(keys):
            stamp = base + 1000 * index
            try:
                os.utime(self.path(key), ns=(stamp, stamp))
            except OSError:
                continue

    # ------------------------------------------------------------------ reads
    def load(self, key: bytes, out) -> bool:
        """Read `key`'s block into `out` (a writable buffer of `block_nbytes`); False (and a log line) on a miss.
        A write of `key` still queued is waited for first: a file not written yet is no miss."""
        path = self.path(key)
        with self._lock:
            queued = self._queued.get(key)
        if queued is not None:
            with self.writes_running():
                queued.wait()
        try:
            with open(path, "rb") as file:
                header = file.read(_HEADER.size)
                if len(header) != _HEADER.size:
                    return self._miss(path, "its header is truncated")
                magic, fingerprint_bytes, file_key, nbytes, checksum = _HEADER.unpack(header)
                if magic != MAGIC:
                    return self._miss(path, "it is not a pagedkv block file")
                if fingerprint_bytes != self.fingerprint:
                    return self._miss(path, "it was written by another model or config")
                if file_key != key or nbytes != self.block_nbytes:
                    return self._miss(path, f"it holds another block ({nbytes} bytes, expected {self.block_nbytes})")
                view = memoryview(out).cast("B")
                if file.readinto(view) != nbytes or file.read(1):
                    return self._miss(path, "its length is wrong (torn or truncated)")
                if hashlib.sha256(view).digest() != checksum:
                    return self._miss(path, "its checksum does not match (corrupt)")
        except FileNotFoundError:
            return self._miss(path, "it is gone")
        except OSError as error:
            return self._miss(path, f"it cannot be read ({error})")
        return True

    @staticmethod
    def _miss(path: Path, why: str) -> bool:
        logger.warning("KV disk tier: %s is a miss: %s", path.name, why)
        return False

    # ------------------------------------------------------------------ writes
    def write_async(self, key: bytes, data, ready=None) -> threading.Event:
        """Queue writing `data` (a buffer of one block) as `key`'s file; `ready()` is called first (a CUDA
        event's synchronize). The returned event is set once the buffer is no longer read."""
        done = threading.Event()
        with self._lock:
            self._queued[key] = done
        self._jobs(key).put(("write", key, data, ready, done))
        return done

    @property
    def writes_held(self) -> bool:
        """Whether queued writes and deletes wait now (held, and no caller waits for one)."""
        return not self._may_write.is_set()

    @contextlib.contextmanager
    def holding_writes(self):
        """Hold the writes for the block (`hold_writes`), then let them run."""
        self.hold_writes()
        try:
            yield
        finally:
            self.release_writes()

    def hold_writes(self) -> None:
        """Queued writes and deletes wait until `release_writes` (one under way finishes), except while a caller
        waits for a write (`writes_running`)."""
        with self._lock:
            self._held = True
            if not self._num_waiting:
                self._may_write.clear()

    def release_writes(self) -> None:
        """Let queued writes and deletes run."""
        with self._lock:
            self._held = False
            self._may_write.set()

    @contextlib.contextmanager
    def writes_running(self):
        """Let queued writes run while the block waits for one of them, on any thread; the engine's hold, if it
        holds them, resumes after the last such wait."""
        with self._lock:
            self._num_waiting += 1
            self._may_write.set()
        try:
            yield
        finally:
            with self._lock:
                self._num_waiting -= 1
                if self._held and not self._num_waiting:
                    self._may_write.clear()

    def delete_async(self, key: bytes) -> None:
        """Queue removing `key`'s file (the size cap evicted it)."""
        self._jobs(key).put(("delete", key, None, None, None))

    def write(self, key: bytes, data) -> bool:
        """Write `key`'s file now, atomically; False if it failed (a fatal error turns the tier off)."""
        if self.disabled_reason is not None:
            return False
        view = memoryview(data).cast("B")
        header = _HEADER.pack(MAGIC, self.fingerprint, key, view.nbytes, hashlib.sha256(view).digest())
        final = self.path(key)
        temp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(temp, "wb") as file:
                file.write(header)
                file.write(view)
            os.replace(temp, final)
            return True
        except OSError as error:
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass
            if error.errno in _FATAL_ERRNOS:
                self._disable(f"writing {final} failed: {error.strerror or error}")
            else:
                logger.warning("KV disk tier: writing %s failed: %s", final.name, error)
            return False

    def _disable(self, reason: str) -> None:
        with self._lock:  # writer threads may fail together: one reason, one warning
            if self.disabled_reason is not None:
                return
            self.disabled_reason = reason
        logger.warning("KV disk tier off: %s; serving goes on without it", reason)

    def _work(self, jobs: queue.Queue) -> None:
        try:  # Linux: a thread id names the thread alone, so only the writer yields the CPU
            own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, own + WRITER_NICENESS))
        except (AttributeError, OSError):  # no per-thread priorities here, or not allowed: run at the process's
            pass
        while True:
            job = jobs.get()
            if job is None:
                jobs.task_done()
                return
            kind, key, data, ready, done = job
            try:
                if kind == "delete":
                    self._may_write.wait()
                    try:
                        self.path(key).unlink(missing_ok=True)
                    except OSError as error:
                        logger.warning("KV disk tier: removing %s failed: %s", key.hex(), error)
                    continue
                ok = False
                try:
                    if ready is not None:  # the copies that fill the buffer (a CUDA event), waited for before the
                        ready()  # hold: a write whose copies end while the engine holds the writes starts after it
                    self._may_write.wait()
                    ok = self.write(key, data)
                except Exception as error:  # noqa: BLE001 - a write that fails is a block not cached
                    logger.warning("KV disk tier: writing %s failed: %s", key.hex(), error)
                with self._lock:
                    self._results.append((key, ok))
            finally:
                if done is not None:
                    with self._lock:
                        if self._queued.get(key) is done:
                            del self._queued[key]
                    done.set()
                jobs.task_done()

    def poll(self) -> list[tuple[bytes, bool]]:
        """(key, written) of writes finished since the last poll."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        with self.writes_running():
            for jobs in self._queues:
                jobs.join()

    def close(self) -> None:
        """Finish the queued work and stop the writer threads (idempotent)."""
        self.release_writes()
        for jobs, thread in zip(self._queues, self._threads):
            if thread.is_alive():
                jobs.put(None)
        for thread in self._threads:
            thread.join()
