"""The KV tiers' tensors: a pinned host pool of blocks, the copies in and out of it, and the disk tier.

The scheduler decides what moves (`pagedkv.core.kv_tiers`); this module moves it. A step's
copies run on two side CUDA streams, in an order that keeps every block valid:

    copy stream   host -> staging tensor: swap-ins, in-step restores (nothing else uses it: beside the step before)
                  | wait for the main stream (the step before wrote the blocks the spills read, and may read
                  | the blocks the scatter fills) | gather: swap-outs, spills -> event G | scatter the staged
                  -> event A | host -> device: restores beside the step | gather: pre-spills          -> event B
    out stream    waits for G, then the gathered blocks -> host (the pre-spills' after their gather)   -> event C
    main stream   waits for A before this step's kernels (they may reuse spilled blocks, and read the
                  swapped-in and in-step restored ones), and for B only at the next step.

The kernels wait for the on-device gather of the blocks they may overwrite (~1 ms for a thousand blocks), never
for those blocks' PCIe copies to the host (~35 ms for a thousand Qwen3-0.6B blocks, what a cold long prompt
evicts in one step). The host copies run on a stream of their own: on the copy stream, the next step's restores
and events would queue behind them. A restore in the step that spilled its host block reads the gathered tensor
(the host copy may not have run yet); a later step's copy that reads or fills a host block whose copy out is still
in flight waits for that copy's event C (per host block, only then: before event A for the copies A covers, after
it for those beside the step). A disk read into host blocks, or a disk write out of them, waits for the copy stream
and for the events C that fill those blocks. Gathered blocks waiting for their copies out are capped
(`MAX_BYTES_COPYING_OUT`: a gather past it waits for the oldest copies first).

On the H200 the out stream took the warm turns' TTFT P99 of a multi-turn chat with 16K-token prefixes from 94.6 to
63.4 ms, and costs the chat with 1K-token prefixes (spills of tens of blocks per step) nothing measurable against
small batches copied on the copy stream before the kernels (`benchmarks/results/kv_tiers_ab_5463ea4`).

Where a restored request computes is a cost question. A block of 16 tokens holds 1.84 MB of
K/V in bf16 for Qwen3-0.6B (2.10 MB for Llama-3-8B), 33 us (38 us) at the ~55 GB/s of a pinned
host -> device copy on an H200, against ~480 us to compute its 16 tokens in a Qwen3-0.6B
prefill (30 us/token in the engine's fitted cost model; Llama-3-8B ~10x more). Restored in the
step (event A), the copy delays every row of the step by its length; restored beside it (event
B), the request waits one whole step (a decode step is several ms, a step with prefill tokens
tens of ms) and the copy is free if it fits under the forward. So a step's first
`max_num_batched_tokens / block_size` restored blocks go before its kernels: a token budget's
worth of KV (at the default 2,048 tokens, 128 blocks) copies in ~5 ms, a tenth of the time to
compute it or less, so the restored request wins a step and the others lose less than it wins.
Restores past that run beside the step, where a long copy overlaps the forward instead of
stalling it. (Waiting per
layer instead, layer l's copy done before layer l's attention, would hide all but one layer's
share of the copy, but the pool is [2, L, N, B, Hkv, D]: one block's layer is two 32 KiB pieces,
so a per-layer copy is 2n small strided copies per layer, and its L waits would sit inside the
decode graphs, which capture the whole model. Within the cap the whole wait is a few ms.)

Disk reads and writes run on threads beside the steps (`kv_disk_io.py`). Between the pool's layout and a
contiguous staging tensor, blocks move by one Triton kernel per direction (`pagedkv.kernels.block_moves`:
torch's index_select + contiguous and index_copy_ ran at a fraction of the device's copy bandwidth).

Early restores (`EngineConfig.kv_offload_early_restore`, the default on one rank): the scheduler hands a
restore's host blocks over as soon as it has chosen them (`stage_restore`), before it evicts and allocates the
GPU blocks they go to and before the step is built; their copies into a staging tensor of their own start then,
on a stream of their own (the stage stream), and `move` only scatters that tensor on the copy stream, after
the copy stream's wait for the main stream (as any scatter) and for the staged copies. On the copy stream
itself the staged copies would hold up the step's gathers behind them, and with the gathers the main stream:
on the H200 the first warm 16K turn after a run of cold ones, whose admission also spilled the blocks they
left, waited ~20 ms longer than the others. The host blocks a staged copy reads are busy from the admission on,
so nothing writes them before the copy stream (whose scatter waits for that copy) has let them go; a spill or
disk read into them after that is ordered after the copy stream. On the H200 a warm turn on a 16K-token prefix
admitted its restore 9-14 ms (under the profiler) before the copy began; staged at admission the copy begins
3-6 ms after submission, and the turn's TTFT falls by ~5 ms (of ~50). A staged restore the step does not name
whole (the admission did not go through) is dropped (nothing waits for its copies, whose result nothing reads);
a restore whose host blocks a spill of the same step fills is not staged (`KVTiers.stage`: that copy to the
host runs with the moves).

A pre-spill copies a cached block the GPU is likely to evict soon, which no kernel of this step
writes, so that its eviction later needs no copy (and no wait) at all.

A host block is `[2, num_layers, block_size, num_kv_heads, head_dim]` contiguous (K then V),
so a block is one run of bytes: one file on disk, one `readinto` back. FP8 pools move their
raw bytes; their scales are fixed for the pool's life and part of the disk fingerprint.
Host-to-device copies are timed twice: the pinned copies into a staging tensor alone
(`h2d_copy_seconds`, the rate to set against the pinned copy bandwidth) and with the scatter
into the pool's layout (`h2d_seconds`).

On the CPU the same functions run, synchronously, with no stream and no events.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from pagedkv.engine.kv_disk import DiskStore
from pagedkv.engine.kv_disk_io import DiskIO
from pagedkv.kernels.block_moves import gather_blocks, scatter_blocks


@dataclass
class OffloadStats:
    """Bytes moved and seconds spent per direction since startup (device time on CUDA)."""

    d2h_bytes: int = 0
    d2h_seconds: float = 0.0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0  # staged copies plus the scatter into the pool
    h2d_copy_seconds: float = 0.0  # the pinned host -> device copies alone
    h2d_num_copies: int = 0  # host -> device copies issued (one per run of consecutive host blocks)
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_write_bytes: int = 0
    disk_write_waits: int = 0  # spills and swap-outs into a host block that waited for its disk write first
    disk_write_wait_seconds: float = 0.0  # the step loop's time in those waits


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index into ids, first id, length) of each run of consecutive ids."""
    return [(index, first, length) for index, first, length, _ in _source_runs(ids, {})]


def _claim(early: list, copies: list) -> tuple[list, list]:
    """(the pairs of `copies` (host block, device block) that no staged restore of `early` holds whole, and
    (staged restore, its device blocks in its rows' order) for each that one does). A claimed restore leaves
    `early`."""
    if not early or not copies:
        return copies, []
    dst_of = {host: device for host, device in copies}
    claimed = []
    for entry in list(early):
        if all(block in dst_of for block in entry.host_blocks):
            claimed.append((entry, [dst_of.pop(block) for block in entry.host_blocks]))
            early.remove(entry)
    if not claimed:
        return copies, []
    return [c for c in copies if c[0] in dst_of], claimed


def _source_runs(src: list[int], row_of: dict[int, int]) -> list[tuple[int, int, int, bool]]:
    """(index into src, first row, length, from the gathered tensor) of each run of consecutive host blocks in
    `src` that come from one place: the host pool (rows are host blocks), or, for the blocks in `row_of` (host
    blocks this step's spills fill), the gathered tensor of those spills. The spills are gathered in host-block
    order, so consecutive host blocks in `row_of` sit on consecutive rows."""
    runs: list[list] = []
    previous = None
    for index, host in enumerate(src):
        gathered = host in row_of
        if runs and host == previous + 1 and gathered == runs[-1][3]:
            runs[-1][2] += 1
        else:
            runs.append([index, row_of[host] if gathered else host, 1, gathered])
        previous = host
    return [tuple(run) for run in runs]


@dataclass
class _Staged:
    """A restore's host blocks copied at admission (`KVOffload.stage_restore`) into `staged`, in host-block order;
    `start` and `copied` time the copies (CUDA events, or perf_counter on the CPU)."""

    host_blocks: list[int]
    staged: torch.Tensor
    start: object
    copied: object


class _Ready:
    """What a disk reader or writer waits for before it touches its host blocks: a few CUDA events (blocking ones,
    so that a waiting thread sleeps instead of spinning a core), queried or waited for together."""

    def __init__(self, events: list):
        self.events = events

    def query(self) -> bool:
        return all(event.query() for event in self.events)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


class _PinnedIds:
    """Block ids copied to the device from a few pinned host buffers, taken in turn (pinning a fresh tensor
    for every step cost more host time than the rest of the ids' path).

    A buffer is written again only once the copy that read it last has run (its event: in practice long done,
    as the buffers are taken in turn). The device buffer is read by the copy stream's kernels alone, in stream
    order, so the next step's copy into it on the same stream waits for them."""

    NUM_SLOTS = 4

    def __init__(self, device: torch.device, stream):
        self.device = device
        self.stream = stream
        self._host: list[torch.Tensor | None] = [None] * self.NUM_SLOTS
        self._read: list = [None] * self.NUM_SLOTS  # each buffer's last copy to the device
        self._next = 0
        self._on_device = torch.empty(0, dtype=torch.int64, device=device)

    def to_device(self, ids: list[int]) -> torch.Tensor:
        """`ids` on the device (a view of the device buffer, valid on the copy stream until the next call)."""
        n = len(ids)
        slot, self._next = self._next, (self._next + 1) % self.NUM_SLOTS
        if self._read[slot] is not None:
            self._read[slot].synchronize()
        host = self._host[slot]
        if host is None or host.numel() < n:
            host = self._host[slot] = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        host.numpy()[:n] = ids
        with torch.cuda.stream(self.stream):
            if self._on_device.numel() < n:  # allocated on the copy stream: the old one is freed in its order
                self._on_device = torch.empty(max(n, 2 * self._on_device.numel(), 256), dtype=torch.int64,
                                              device=self.device)
            out = self._on_device[:n]
            out.copy_(host[:n], non_blocking=True)
            event = self._read[slot] = self._read[slot] or torch.cuda.Event()
            event.record(self.stream)
        return out


class KVOffload:
    """A pinned host pool beside the device pool, its copy streams, and the optional disk store."""

    # Gathered blocks waiting for their copies to the host, beyond which a new gather waits (~36 ms of PCIe)
    MAX_BYTES_COPYING_OUT = 2 << 30

    def __init__(self, pool, num_host_blocks: int, *, disk: DiskStore | None = None, tp=None, shared_host=None):
        self.pool = pool
        self.device = pool.device
        self.is_cuda = self.device.type == "cuda"
        storage = pool.kv_storage  # [2, L, N, B, Hkv, D] (uint8 bytes for FP8)
        self._storage = storage
        block_shape = (2, storage.shape[1], *storage.shape[3:])
        # Empty, not zeroed: a host block is always written (a spill, a swap-out, a disk read) before it is read,
        # and zeroing tens of GiB of pinned memory would cost seconds of startup.
        # `shared_host` (a `kv_disk_process.SharedHostPool`, pinned on CUDA): the pool in shared memory, which a
        # writer process reads.
        self._shared_host = shared_host
        if shared_host is not None:
            self.host = shared_host.tensor.view(storage.dtype).view(num_host_blocks, *block_shape)
        else:
            self.host = torch.empty((num_host_blocks, *block_shape), dtype=storage.dtype, pin_memory=self.is_cuda)
        self._host_bytes = self.host.view(torch.uint8).reshape(num_host_blocks, -1).numpy()  # [Nh, bytes]
        self.block_nbytes = self._host_bytes.shape[1]
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.out_stream = torch.cuda.Stream(self.device) if self.is_cuda else None  # gathered blocks -> host
        # Restores staged at admission (`stage_restore`): a stream of their own, so that the step's gathers on the
        # copy stream (and the main stream waiting for them) never queue behind a long restore's copies.
        self.stage_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._restores_done = None  # event B of the last step that restored
        # (event C, host blocks, bytes, gathered blocks) of the copies to the host that may be in flight
        self._copying_out: list[tuple] = []
        # (event C, host blocks) of copies to the host that `_hold_back_copies_out` let go of (the copy stream
        # waits for them) and that may still run: the stage stream, which that wait does not cover, still must
        self._held_out: list[tuple] = []
        self._timings: list[tuple] = []  # (direction, bytes, start, copied, resumed, end): CUDA events or None
        self._free_events: list = []  # timing events whose copies finished and were accounted: recorded again
        self._ids = _PinnedIds(self.device, self.stream) if self.is_cuda else None
        self._early: list[_Staged] = []  # restores staged since the last step (`stage_restore`)
        self.disk = disk
        self.stats = OffloadStats()
        self.io = DiskIO(disk, self._host_bytes, self.stats, tp)

    @property
    def num_host_blocks(self) -> int:
        """Blocks in the host pool (swap space plus the host tier)."""
        return self.host.shape[0]

    # ------------------------------------------------------------------ one step
    def move(self, step) -> None:
        """Run a step's block moves (see the module docstring); returns once the main stream is ordered after them."""
        early, self._early = self._early, []  # what this step does not claim is dropped
        if step.persist or step.persist_host or step.persist_order:
            self.persist(step.persist, step.persist_host, step.persist_order)
        if self._restores_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._restores_done)
            self._restores_done = None
        self._collect_timings()
        if self._copying_out:  # let go of finished copies out (their gathered blocks with them), once a step
            self._copying_out = [entry for entry in self._copying_out if not entry[0].query()]
        if self._held_out:
            self._held_out = [entry for entry in self._held_out if not entry[0].query()]
        if not self.io.reports:
            self.io.poll()  # a worker rank: nobody reads its results, but its finished writes must be let go
        if step.disk_loads:  # copies issued before this step may still read or fill the host blocks these fill
            self.io.load(step.disk_loads, self._ready([block for _, block in step.disk_loads]))
        d2h = list(step.swap_out) + list(step.offload)
        h2d = list(step.swap_in) + list(step.restore_in_step)  # one batched copy the step's kernels wait for
        beside = step.restore or step.pre_offload  # copies the next step waits for, not this one
        if not (d2h or h2d or beside or step.disk_writes or step.disk_deletes):
            return
        self.io.wait_writes(dst for _, dst in d2h + list(step.pre_offload))
        # Both directions go in host-block order: the gather and the scatter on the device take any order
        # for free, and a prefix spilled tail first (the GPU cache's eviction order) sits on descending host
        # blocks, which in prefix order would be one small copy per block instead of one copy per run.
        d2h, pre_offload = (sorted(c, key=lambda c: c[1]) for c in (d2h, step.pre_offload))
        h2d, restore = (sorted(c, key=lambda c: c[0]) for c in (h2d, step.restore))
        h2d, h2d_staged = _claim(early, h2d)
        restore, restore_staged = _claim(early, restore)
        ids = self._device_ids([[c[0] for c in d2h], [c[1] for c in h2d], [c[1] for c in restore],
                                [c[0] for c in pre_offload], *(dst for _, dst in h2d_staged + restore_staged)])
        staged_ids = ids[4:4 + len(h2d_staged)], ids[4 + len(h2d_staged):]
        ready = None
        if not self.is_cuda:
            self._d2h(d2h, ids[0])
            self._h2d(h2d, ids[1])
            self._scatter_staged(h2d_staged, staged_ids[0])
            self._h2d(restore, ids[2])
            self._scatter_staged(restore_staged, staged_ids[1])
            self._d2h(pre_offload, ids[3])
        else:
            main = torch.cuda.current_stream(self.device)
            # The spills' gathered blocks (set by the gather) and {host block: row of them}.
            spills = [None, {host: row for row, (_, host) in enumerate(d2h)}]

            def after_the_step_before() -> None:
                self.stream.wait_stream(main)
                spills[0] = self._d2h(d2h, ids[0])

            with torch.cuda.stream(self.stream):
                # The host blocks the copies before event A read: ordered after the copies to the host still in
                # flight that fill them; the same for the restores beside the step, after event A (so that A never
                # waits for them). (The copies to the host themselves all run in order on the out stream.)
                if self._copying_out:
                    self._wait_copies_out([c[0] for c in h2d])
                self._h2d(h2d, ids[1], after_the_step_before, spills)  # staged beside the step before (see above)
                self._scatter_staged(h2d_staged, staged_ids[0])  # (after the wait for the main stream above)
                spilled = torch.cuda.Event()
                spilled.record(self.stream)
                if beside:
                    if self._copying_out:  # (blocks this step spills are read from the gathered tensor: no wait)
                        self._wait_copies_out([c[0] for c in restore if c[0] not in spills[1]])
                    self._h2d(restore, ids[2], spills=spills)
                    self._scatter_staged(restore_staged, staged_ids[1])
                    self._d2h(pre_offload, ids[3])
                    self._restores_done = torch.cuda.Event()
                    self._restores_done.record(self.stream)
            if d2h or h2d or h2d_staged:
                main.wait_event(spilled)  # outside any graph: the step's graphs are launched after this
            if step.disk_writes:  # their host blocks are filled by this step's copies to the host or earlier ones
                ready = self._ready([block for _, block in step.disk_writes])
        self.io.write(step.disk_writes, ready)
        self.io.delete(step.disk_deletes)

    def stage_restore(self, host_blocks: list[int]) -> None:
        """Start copying a restore's host blocks to the device now, into a staging tensor of their own (in
        host-block order: one copy per run of consecutive blocks), ordered after the copies to the host still in
        flight that fill them; the step's `move` scatters it (see the module docstring). The blocks are busy on
        the host tier from the caller on, so nothing writes them before the copies have read them."""
        blocks = sorted(host_blocks)
        stream = self.stage_stream
        with torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext():
            if self._copying_out or self._held_out:
                self._wait_copies_out(blocks, stream)
            self._early.append(_Staged(blocks, *self._stage(len(blocks), _source_runs(blocks, {}), stream)))

    def _stage(self, num_blocks: int, runs, stream=None) -> tuple[torch.Tensor, object, object]:
        """A staging tensor of `num_blocks` blocks on the device with the `_source_runs` runs not from the gathered
        tensor copied in from the host pool (on the current stream, which is `stream`, default the copy stream),
        and the marks around those copies (recorded on it)."""
        start = self._mark(stream)
        staged = torch.empty((num_blocks, *self.host.shape[1:]), dtype=self.host.dtype, device=self.device)
        for index, first, length, gathered in runs:
            if not gathered:
                staged[index:index + length].copy_(self.host[first:first + length], non_blocking=True)
        self.stats.h2d_num_copies += sum(not gathered for *_, gathered in runs)
        return staged, start, self._mark(stream)

    def _scatter_staged(self, claimed: list[tuple[_Staged, list[int]]], ids: list[torch.Tensor]) -> None:
        """Scatter each staged restore into its GPU blocks (`ids`: their device ids in its rows' order)."""
        for (entry, _), dst in zip(claimed, ids):
            if self.is_cuda:  # its copies ran on the stage stream; the tensor was allocated there
                self.stream.wait_event(entry.copied)
                # The copy stream reads it after the last reference here is dropped: record_stream keeps its
                # memory from reuse on the stage stream until the scatter is done. (`_d2h` instead holds its
                # gathered tensor in `_copying_out` until the event of its copies to the host has passed:
                # record_stream held that memory back from reuse longer.)
                entry.staged.record_stream(self.stream)
            resumed = self._mark()
            scatter_blocks(self._storage, dst, entry.staged)
            self._done("h2d", len(entry.host_blocks) * self.block_nbytes, entry.start, entry.copied, resumed)

    def _filling(self, host_blocks) -> list:
        """The events C of the copies to the host still in flight (on the out stream) that fill one of
        `host_blocks`."""
        if not self._copying_out and not self._held_out:
            return []
        wanted = set(host_blocks)
        return [event for event, filling, *_ in self._copying_out + self._held_out if not filling.isdisjoint(wanted)]

    def _wait_copies_out(self, host_blocks: list[int], stream=None) -> None:
        """Make `stream` (default the copy stream) wait for the copies to the host in flight that fill one of
        `host_blocks`."""
        for event in self._filling(host_blocks):
            (stream or self.stream).wait_event(event)

    def _ready(self, host_blocks: list[int]) -> _Ready | None:
        """What a disk thread that reads or fills `host_blocks` waits for: the copies issued so far on the copy
        stream, and the copies to the host in flight that fill one of them (not the whole out stream)."""
        if not self.is_cuda:
            return None
        issued = torch.cuda.Event(blocking=True)
        issued.record(self.stream)
        return _Ready([issued, *self._filling(host_blocks)])

    def _hold_back_copies_out(self, nbytes: int) -> None:
        """Make the copy stream (so the gather about to run, and the step that waits for it) wait for the oldest
        copies to the host still in flight while they and the `nbytes` about to be gathered hold more than
        `MAX_BYTES_COPYING_OUT` of gathered blocks: spills are made no faster than prefills compute KV, far below
        PCIe, but a burst must not pile up device memory without bound."""
        pending = self._copying_out
        held = sum(entry[2] for entry in pending)
        while pending and held + nbytes > self.MAX_BYTES_COPYING_OUT:
            event, filling, freed, _ = pending.pop(0)  # after this wait, the copy stream's order covers its blocks
            self.stream.wait_event(event)
            self._held_out.append((event, filling))  # (not the stage stream's: see `_filling`)
            held -= freed

    def _mark(self, stream=None):
        """A point in time: a CUDA event recorded on `stream` (default the copy stream; a finished event reused),
        or perf_counter on the CPU."""
        if not self.is_cuda:
            return time.perf_counter()
        event = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        event.record(stream or self.stream)
        return event

    def _done(self, direction: str, nbytes: int, start, copied=None, resumed=None, stream=None) -> None:
        """Account a copy from `start` to now on `stream` (`copied`: its host -> device part ended; `resumed`:
        scatter began)."""
        end = self._mark(stream)
        if self.is_cuda:
            self._timings.append((direction, nbytes, start, copied, resumed, end))
        else:  # as `_collect_timings`: the copies, then from `resumed` on (a staged restore waits between them)
            seconds = end - start if resumed is None else (copied - start) + (end - resumed)
            self._account(direction, nbytes, seconds, None if copied is None else copied - start)

    def _account(self, direction: str, nbytes: int, seconds: float, copy_seconds: float | None) -> None:
        st = self.stats
        if direction == "d2h":
            st.d2h_bytes += nbytes
            st.d2h_seconds += seconds
        else:
            st.h2d_bytes += nbytes
            st.h2d_seconds += seconds
            st.h2d_copy_seconds += seconds if copy_seconds is None else copy_seconds

    def _collect_timings(self) -> None:
        """Fold in the device times of copies that have finished (never waits)."""
        pending = []
        for timing in self._timings:
            direction, nbytes, start, copied, resumed, end = timing
            if end.query():
                copy_s = None if copied is None else start.elapsed_time(copied) / 1e3
                seconds = start.elapsed_time(end) if resumed is None else (
                    start.elapsed_time(copied) + resumed.elapsed_time(end))
                self._account(direction, nbytes, seconds / 1e3, copy_s)
                self._free_events.extend({id(e): e for e in (start, copied, resumed, end) if e is not None}.values())
            else:
                pending.append(timing)
        self._timings = pending

    def _device_ids(self, lists: list[list[int]]) -> list[torch.Tensor]:
        """Each list of device block ids as an int64 tensor on the pool's device: one copy for all, on the copy
        stream (nothing to copy for a step that moves no block: a move given no pairs reads no ids)."""
        flat = [block for blocks in lists for block in blocks]
        ids = self._ids.to_device(flat) if self.is_cuda and flat else torch.tensor(flat, dtype=torch.int64)
        return list(ids.split([len(blocks) for blocks in lists]))

    def _d2h(self, copies, src):
        """(device block, host block) pairs in host-block order, `src` their device ids: gather on the device,
        then one copy per run of host blocks (on CUDA on the out stream, after the gather). Returns the gathered
        blocks [n, 2, L, B, Hkv, D] (None if no pairs)."""
        if not copies:
            return None
        nbytes = len(copies) * self.block_nbytes
        out = self.out_stream
        if out is not None:
            self._hold_back_copies_out(nbytes)
        start = self._mark() if out is None else None
        dst = [c[1] for c in copies]
        blocks = gather_blocks(self._storage, src)  # [n, 2, L, B, Hkv, D]
        if out is not None:
            out.wait_stream(self.stream)
            start = self._mark(out)  # the copy's own time, not the gather's or the queue's before it
        with torch.cuda.stream(out) if out is not None else contextlib.nullcontext():
            for index, first, length in _runs(dst):
                self.host[first:first + length].copy_(blocks[index:index + length], non_blocking=True)
            self._done("d2h", nbytes, start, stream=out)
            if out is not None:
                copied_out = torch.cuda.Event(blocking=True)
                copied_out.record(out)
                # `blocks` (allocated on the copy stream) is kept until its copies are done, then let go: no
                # `record_stream`, whose allocator events kept its memory from reuse on the copy stream longer.
                self._copying_out.append((copied_out, set(dst), nbytes, blocks))
        return blocks

    def _h2d(self, copies, dst, before_scatter=None, spills=(None, {})) -> None:
        """(host block, device block) pairs in host-block order, `dst` their device ids: one copy per run of
        host blocks into a staging tensor, then `before_scatter()` if given (what must precede the scatter
        on the copy stream), then one scatter. A host block that this step's spills fill (`spills`: their
        gathered blocks, which `before_scatter` may produce, and {host block: row of them}) is staged from the
        gathered blocks instead, after `before_scatter`: its copy to the host may not have run yet."""
        if not copies:
            if before_scatter is not None:
                before_scatter()
            return
        runs = _source_runs([c[0] for c in copies], spills[1])
        staged, start, copied = self._stage(len(copies), runs)
        resumed = copied
        if before_scatter is not None:
            before_scatter()
            resumed = self._mark()
        for index, first, length, gathered in runs:
            if gathered:
                staged[index:index + length].copy_(spills[0][first:first + length])
        scatter_blocks(self._storage, dst, staged)
        self._done("h2d", len(copies) * self.block_nbytes, start, copied, resumed)

    # ------------------------------------------------------------------ the bookkeeping's side
    def finish_loads(self, failed: bool = False, wait: bool = True) -> None:
        """Collect the step's disk reads (`DiskIO.finish_loads`)."""
        self.io.finish_loads(failed, wait)

    def index_disk(self, tiers) -> None:
        """Fill `tiers`' disk index from the files found, or turn the disk tier off (`DiskIO.index_disk`)."""
        self.io.index_disk(tiers)

    def settle(self, tiers) -> None:
        """Tell `tiers` what the disk reads and writes since the last call found (`DiskIO.settle`)."""
        self.io.settle(tiers)

    def stats_fields(self, tiers) -> dict:
        """The KV tiers' fields of `EngineStats`: `tiers`' counters and this pool's bytes and times."""
        t, o = tiers.stats, self.stats
        return dict(
            kv_gpu_hit_blocks=t.gpu_hit_blocks, kv_host_hit_blocks=t.host_hit_blocks,
            kv_disk_hit_blocks=t.disk_hit_blocks, kv_offloaded_blocks=t.offloaded_blocks,
            kv_restored_blocks=t.restored_blocks, kv_disk_loaded_blocks=t.disk_loaded_blocks,
            kv_disk_load_misses=t.disk_load_misses, kv_disk_written_blocks=t.disk_written_blocks,
            kv_host_blocks=tiers.host.num_blocks, kv_host_cached_blocks=tiers.host.num_cached,
            kv_disk_blocks=tiers.disk.num_blocks if tiers.disk is not None else 0,
            kv_d2h_bytes=o.d2h_bytes, kv_d2h_seconds=o.d2h_seconds, kv_h2d_bytes=o.h2d_bytes,
            kv_h2d_seconds=o.h2d_seconds, kv_h2d_copy_seconds=o.h2d_copy_seconds,
            kv_h2d_num_copies=o.h2d_num_copies, kv_disk_read_bytes=o.disk_read_bytes,
            kv_disk_read_seconds=o.disk_read_seconds, kv_disk_write_bytes=o.disk_write_bytes,
            kv_disk_write_waits=o.disk_write_waits, kv_disk_write_wait_seconds=o.disk_write_wait_seconds,
        )

    def persist(self, from_device, from_host, order=(), chunk_blocks: int = 64) -> None:
        """Write cached blocks to disk now, so a restart finds them ((key, device block) and (key, host block)),
        then give the files the disk tier's LRU `order` (least recently used first) for the restart's index."""
        if self.disk is None:
            return
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        self.disk.flush()
        for start in range(0, len(from_device), chunk_blocks):
            chunk = from_device[start:start + chunk_blocks]
            ids = torch.tensor([block for _, block in chunk], dtype=torch.int64, device=self.device)
            blocks = gather_blocks(self._storage, ids).cpu()
            data = blocks.view(torch.uint8).reshape(len(chunk), -1).numpy()
            for row, (key, _) in enumerate(chunk):
                self.disk.write(key, data[row])
        for key, block in from_host:
            self.disk.write(key, self._host_bytes[block])
        self.disk.flush()
        self.disk.set_order(order)

    def close(self) -> None:
        """Finish queued disk work (and free a shared host pool, once no copy into or out of it is in flight)."""
        try:
            self.io.close()
        finally:
            if self._shared_host is not None:
                if self.is_cuda:
                    torch.cuda.synchronize(self.device)
                self.host = self._host_bytes = self.io._host_bytes = None
                self._shared_host.close()
                self._shared_host = None
