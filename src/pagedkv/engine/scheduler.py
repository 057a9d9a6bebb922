"""The scheduler: which tokens of which sequences run in the next step.

Pure Python, no torch: the engine drives it with a real model and the simulator drives the
very same object against a simulated clock.

`Scheduler` owns the waiting, running and swapped queues and the block manager, and takes
requests in and out of them (`add`, `abort`, `finish`, `fail_request`). A step's two halves are
mixed in from beside it: `StepPlanner.schedule()` (engine/scheduler_plan.py) decides the step,
preempting and admitting, and `StepUpdater` (engine/scheduler_update.py) records it once it is
launched (`advance`) and once its tokens are known (`resolve`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence as SequenceT

from pagedkv.core.block_manager import KVBlockManager
from pagedkv.core.hybrid_block_manager import HybridBlockManager
from pagedkv.engine.scheduler_plan import StepPlanner
from pagedkv.engine.scheduler_types import (PreemptionMode, ScheduledSequence, SchedulerConfig, SchedulerOutput,
                                            SchedulerStats, StepShape, VictimPolicy)
from pagedkv.engine.scheduler_update import StepUpdater
from pagedkv.engine.sequence import FinishReason, Sequence, SequenceStatus
from pagedkv.errors import RequestRejectedError


class Scheduler(StepPlanner, StepUpdater):
    """Owns the waiting, running and swapped queues and the block manager."""

    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = (), seq_ids=None):
        self.config = config
        self.seq_ids = seq_ids if seq_ids is not None else itertools.count()  # shared with whoever creates seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self._has_windows = config.has_windows
        # a budget's worth of restored KV copies in less time than computing it (kv_offload's docstring)
        in_step_tokens = config.max_in_step_restore_tokens
        max_in_step_restores = (config.max_num_batched_tokens if in_step_tokens is None else in_step_tokens) \
            // config.block_size
        if self._has_windows:
            self.block_manager = HybridBlockManager(
                config.kv_layout, config.num_blocks, config.block_size,
                enable_prefix_caching=config.enable_prefix_caching, num_swap_blocks=config.num_swap_blocks,
                max_num_tokens=max(config.max_model_len, config.block_size),
                max_query_tokens=config.max_num_batched_tokens, num_offload_blocks=config.num_offload_blocks,
                disk_capacity_blocks=config.disk_capacity_blocks, max_in_step_restore_blocks=max_in_step_restores,
                write_through=config.kv_write_through)
        else:
            self.block_manager = KVBlockManager(
                config.num_blocks,
                config.block_size,
                enable_prefix_caching=config.enable_prefix_caching and config.reservation == "paged",
                num_swap_blocks=config.num_swap_blocks,
                max_num_tokens=max(config.max_model_len, config.block_size),
                num_offload_blocks=config.num_offload_blocks,
                disk_capacity_blocks=config.disk_capacity_blocks,
                max_in_step_restore_blocks=max_in_step_restores,
                write_through=config.kv_write_through,
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ requests
    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raise `RequestRejectedError` if a request of this size could never be served.

        Reads only the frozen config, so it is safe from any thread (the server calls it from
        request handlers before queueing).
        """
        cfg = self.config
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens < 1:
            raise RequestRejectedError("the prompt is empty: at least one token is needed")
        if total > cfg.max_model_len:
            raise RequestRejectedError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds "
                f"max_model_len {cfg.max_model_len}"
            )
        reserve = cfg.max_model_len if cfg.reservation == "naive" else total
        if cfg.blocks_for_request(reserve) > cfg.num_blocks:
            raise RequestRejectedError(
                f"a request of {reserve} tokens needs {cfg.blocks_for_request(reserve)} blocks, but the "
                f"whole KV pool has {cfg.num_blocks} blocks ({cfg.capacity_tokens} tokens)"
            )
        if n > cfg.max_num_seqs:
            raise RequestRejectedError(f"n = {n} parallel samples cannot run beside each other: max_num_seqs is "
                                       f"{cfg.max_num_seqs}")
        if n > 1 and cfg.reservation == "naive":
            raise RequestRejectedError("parallel sampling (n > 1) shares blocks, which naive reservation cannot do")
        if not cfg.enable_chunked_prefill and total > cfg.max_num_batched_tokens:
            raise RequestRejectedError(
                f"without chunked prefill, {total} tokens cannot run in one step of at most "
                f"{cfg.max_num_batched_tokens} batched tokens"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises `RequestRejectedError` (nothing queued) if it can never fit."""
        try:
            self.check_fits(seq.num_prompt_tokens, seq.sampling_params.max_tokens, seq.sampling_params.n)
        except RequestRejectedError:
            self.stats.num_rejected += 1
            raise
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq_ids: Iterable[int]) -> list[Sequence]:
        """Remove these sequences from every queue and free their blocks at once."""
        wanted = set(seq_ids)
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for seq in [s for s in queue if s.seq_id in wanted]:
                queue.remove(seq)
                self._finish(seq, FinishReason.ABORT)
                aborted.append(seq)
        return aborted

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is queued (the engine calls this for stop strings).

        Tokens still pending on the device belong to steps after the one that ended it, so they
        are dropped.
        """
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.drop_pending(seq)
        self._finish(seq, reason)

    @staticmethod
    def drop_pending(seq: Sequence) -> None:
        """Forget `seq`'s tokens still on the device (their steps' results will be ignored)."""
        if seq.num_pending:
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fail_request(self, request_id: str, error: BaseException, out: SchedulerOutput | None = None) -> None:
        """End every sequence of `request_id` with ERROR and free its blocks (its step-mates go on).

        Records `error` in `out.failed`. Sequences forked in this step (`out.forked`) are freed
        too, even one that failed halfway into the running queue.
        """
        doomed = [seq for queue in (self.waiting, self.running, self.swapped) for seq in queue
                  if seq.request_id == request_id]
        if out is not None:
            out.failed[request_id] = error
            doomed += [seq for seq in out.forked if seq.request_id == request_id and seq not in doomed]
        for seq in doomed:
            for queue in (self.running, self.waiting, self.swapped):
                if seq in queue:
                    queue.remove(seq)
            self.drop_pending(seq)
            self._finish(seq, FinishReason.ERROR)

    # ------------------------------------------------------------------ internals
    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_integrity(self) -> None:
        """Assert queues and blocks agree: running sequences hold blocks, others hold none on the GPU."""
        bm = self.block_manager
        bm.check_integrity()
        ids = [s.seq_id for s in (*self.waiting, *self.running, *self.swapped)]
        assert len(ids) == len(set(ids)), "a sequence is in two queues"
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING and bm.has_table(seq.seq_id), seq
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not bm.has_table(seq.seq_id), seq
        for seq in self.swapped:
            assert seq.status is SequenceStatus.SWAPPED and bm.is_swapped(seq.seq_id), seq


__all__: SequenceT[str] = [
    "PreemptionMode",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StepShape",
    "VictimPolicy",
]
