"""The disk tier beside the steps: a step's disk reads into host blocks, the write-behind of host blocks to disk, and
what both found, for the tiers' bookkeeping (`pagedkv.core.kv_tiers`).

Disk reads (a prompt's prefix found on disk) run on a few reader threads from the start of the
step. The runner collects those done after it has launched the step's kernels and leaves the rest
running: a slow read never holds a step up, and its prompt is admitted at the step after it is
done (in the meantime the prompts behind it are admitted). A step with nothing to compute waits for
them; under tensor parallelism every step does, so that the ranks agree on hits.

Writes run on the `DiskStore`'s writer threads, each reading its host block after the step's copies
that fill it. A copy into a host block whose write is still queued waits for that write first
(`wait_writes`); the host tier takes such a block only when no other is free to take
(`pagedkv.core.host_tier`), and the waits are counted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from pagedkv.engine.kv_disk import DiskStore

logger = logging.getLogger("pagedkv")

#: Threads that read a step's disk blocks into host memory, beside the step's launch.
NUM_READ_THREADS = 4


class DiskIO:
    """Reads into and writes from the host pool's blocks (`host_bytes`: [num host blocks, bytes per block]) through
    a `DiskStore` (None: no disk tier), accounting bytes, times and waits in `stats` (an `OffloadStats`)."""

    def __init__(self, disk: DiskStore | None, host_bytes, stats, tp=None):
        self.disk = disk
        self._host_bytes = host_bytes
        self.block_nbytes = host_bytes.shape[1]
        self.stats = stats
        self._writing: dict[int, object] = {}  # host block -> done event of its pending disk write
        self._writing_swept_size = 64  # `poll` sweeps finished writes out of `_writing` past this size
        self._readers = ThreadPoolExecutor(NUM_READ_THREADS, "pagedkv-kv-read") if disk is not None else None
        self._reading: list[tuple[list, object]] = []  # (loads, future) of this step's disk reads
        self.tp = tp
        self.reports = tp is None or tp.rank == 0  # only the scheduling rank consumes results
        self._load_results: list[tuple[bytes, bool]] = []

    def wait_writes(self, host_blocks) -> None:
        """A host block about to be overwritten must first be done being written to disk (the host tier takes such
        a block only when no other is free to take: `pagedkv.core.host_tier`)."""
        if not self._writing:
            return
        for block in host_blocks:
            done = self._writing.pop(block, None)
            if done is not None and not done.is_set():
                start = time.perf_counter()
                with self.disk.writes_running():  # the engine may hold them (see kv_disk)
                    done.wait()
                self.stats.disk_write_waits += 1
                self.stats.disk_write_wait_seconds += time.perf_counter() - start

    def holding_writes(self):
        """A context that holds the disk writes (see `kv_disk`: the step loop holds them while it runs Python)."""
        return self.disk.holding_writes() if self.disk is not None else contextlib.nullcontext()

    def writes_running(self):
        """A context that lets held disk writes run while it waits (the step loop's wait for the device)."""
        return self.disk.writes_running() if self.disk is not None else contextlib.nullcontext()

    def write(self, writes, ready) -> None:
        """Queue writing each (key, host block) of `writes` to disk, after `ready` (a CUDA event recorded after the
        copies that fill them, or None)."""
        if not writes or self.disk is None:
            return
        by_block = getattr(self.disk, "takes_blocks", False)  # a writer process reads the shared pool itself
        after = ready if by_block or ready is None else ready.synchronize
        for key, block in writes:
            data = None if by_block else self._host_bytes[block]
            self._writing[block] = self.disk.write_async(key, data, after, **({"block": block} if by_block else {}))
            self.stats.disk_write_bytes += self.block_nbytes

    def delete(self, keys) -> None:
        """Queue removing the files of `keys` (the size cap evicted them)."""
        if self.disk is not None:
            for key in keys:
                self.disk.delete_async(key)

    def load(self, loads, ready) -> None:
        """Start reading files into host blocks on the reader threads, each after `ready` (a CUDA event: the copies
        issued before may still read those host blocks) and after the blocks' queued disk writes; `finish_loads`
        collects them."""
        writes = [self._writing.pop(block, None) for _, block in loads]
        writes = [done for done in writes if done is not None]
        size = -(-len(loads) // NUM_READ_THREADS)
        for start in range(0, len(loads), size):
            part = loads[start:start + size]
            future = self._readers.submit(self._read, part, ready, writes) if self._readers is not None else None
            self._reading.append((part, future))

    def _read(self, loads, ready, writes) -> tuple[list[int], float]:
        """On a reader thread: (1 if read, 0 if a miss) per load, and the seconds the reads took."""
        if ready is not None:
            ready.synchronize()
        for done in writes:
            done.wait()
        start = time.perf_counter()
        flags = [int(self.disk.load(key, self._host_bytes[block])) for key, block in loads]
        return flags, time.perf_counter() - start

    def finish_loads(self, failed: bool = False, wait: bool = True) -> None:
        """Collect the disk reads (they run beside the steps' launches): all of them, or without `wait` on one rank
        those done so far (the rest at a later call: a slow read never holds up a step). Under tensor parallelism
        it always waits, the ranks' calls in step: a miss on any rank is a miss on all. After a `failed` step it
        waits and drops them (the keys stay on disk)."""
        if not self._reading:
            return
        reading, pending = [], []
        for read in self._reading:
            done = wait or failed or self.tp is not None or read[1] is None or read[1].done()
            (reading if done else pending).append(read)
        self._reading = pending
        loads, flags, seconds = [], [], 0.0
        # A read may wait for a queued write of its host block (`load`): the writes run while this waits.
        waits = any(future is not None and not future.done() for _, future in reading)
        with self.disk.writes_running() if waits else contextlib.nullcontext():
            for part, future in reading:
                part_flags, part_seconds = future.result() if future is not None else ([0] * len(part), 0.0)
                loads += part
                flags += part_flags
                seconds = max(seconds, part_seconds)  # the threads read side by side
        if failed:
            if self.reports:
                self._load_results.extend((key, None) for key, _ in loads)
            return
        self.stats.disk_read_seconds += seconds
        self.stats.disk_read_bytes += sum(flags) * self.block_nbytes
        if self.tp is not None:
            flags = self.tp.min_ints(flags)
        if self.reports:
            self._load_results.extend((key, bool(ok)) for (key, _), ok in zip(loads, flags))

    def index_disk(self, tiers) -> None:
        """Fill `tiers`' disk index from the files found (a restart), or turn the disk tier off if it cannot run."""
        disk = self.disk
        if disk is None or disk.disabled_reason is not None:
            tiers.disable_disk(disk.disabled_reason if disk is not None else "no disk store")
            return
        for key in disk.scan():
            for evicted in tiers.disk.add(key):
                disk.delete_async(evicted)
        if tiers.disk.num_blocks:
            logger.info("KV disk tier: %d blocks found in %s", tiers.disk.num_blocks, disk.dir)

    def settle(self, tiers) -> None:
        """Tell `tiers` (a `KVTiers`) what the disk reads and writes since the last call found."""
        if self.tp is None:
            self.finish_loads(wait=False)
        loads, writes, disabled = self.poll()
        if loads:
            tiers.finish_loads(loads)
        if writes:
            tiers.finish_writes(writes)
        if disabled is not None and tiers.disk is not None:
            tiers.disable_disk(disabled)

    def poll(self) -> tuple[list[tuple[bytes, bool]], list[tuple[bytes, bool]], str | None]:
        """(disk loads (key, hit), disk writes (key, written), why the disk tier turned off or None) since the
        last poll."""
        loads, self._load_results = self._load_results, []
        if self.disk is None:
            return loads, [], None
        # Finished writes left here are harmless (waiting on a set event returns at once), so the map is swept
        # only once it has doubled: a backlog of thousands of queued writes costs a step nothing.
        if len(self._writing) > self._writing_swept_size:
            self._writing = {block: done for block, done in self._writing.items() if not done.is_set()}
            self._writing_swept_size = 2 * len(self._writing) + 64
        return loads, self.disk.poll(), self.disk.disabled_reason

    def close(self) -> None:
        """Finish queued disk work."""
        if self.disk is not None:
            self.disk.release_writes()  # the readers may wait for queued writes
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
