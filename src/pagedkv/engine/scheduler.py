"""The scheduler: which tokens of which sequences run in the next step.

Pure Python, no torch: the engine drives it with a real model and the simulator drives the
very same object against a simulated clock.

One `schedule()` call, under a budget of `max_num_batched_tokens`:

1. **Running sequences**, least likely victim first. Each gets its next tokens (1 for a
   decode, a chunk for a prefill). When the pool cannot give it a slot, a victim is
   preempted (the most victim-like sequence not yet scheduled, possibly itself): by
   *recompute* (its blocks are freed and it goes back to the front of the waiting queue) or
   by *swap* (its blocks are copied to the CPU swap space).
2. **Swapped sequences** come back (FIFO) when nothing was preempted this step.
3. **Waiting sequences** are admitted in order while the pool keeps `watermark` of its
   blocks free after taking the whole prompt (chunked prefill then spends the token budget
   over several steps). A request that could never fit is refused by `add()`, never queued.
   With KV tiers, a prompt whose prefix is on disk waits until it is loaded into host
   memory (keeping its place, while the prompts behind it are admitted), and one whose
   prefix is restored from host memory is admitted now and computes in this step (its copy
   runs before the step's kernels) or, past the step's in-step restore budget, from the next
   step, when its blocks have arrived.

A step that schedules nothing while work remains is a bug, not a wait: it raises
`SchedulerStallError` rather than letting a caller spin forever.

Decodes are listed before prefills in the output, so the runner can run one decode kernel
over the first rows and one prefill kernel over the rest.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence as SequenceT

from pagedkv.core.block_manager import KVBlockManager
from pagedkv.core.hybrid_block_manager import HybridBlockManager
from pagedkv.core.prefix_cache import block_keys
from pagedkv.engine.scheduler_types import (PreemptionMode, ScheduledSequence, SchedulerConfig, SchedulerOutput,
                                            SchedulerStats, StepShape, VictimPolicy)
from pagedkv.engine.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus
from pagedkv.errors import RequestRejectedError, SchedulerStallError


class Scheduler:
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
                disk_capacity_blocks=config.disk_capacity_blocks, max_in_step_restore_blocks=max_in_step_restores)
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

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring)."""
        out = SchedulerOutput()
        self.block_manager.begin_step()
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        budget = self._schedule_running(out, decodes, prefills, self.config.max_num_batched_tokens)
        if not out.preempted:  # swapped sequences come back first, and only in a step without preemption
            budget = self._schedule_swapped(out, decodes, prefills, budget)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, decodes, prefills, budget)
        out.scheduled = decodes + prefills
        if out.scheduled:
            self.block_manager.pre_spill()  # after every allocation of the step: none of these is written in it
        out.tier_copies = self.block_manager.take_tier_copies()
        self.stats.num_steps += 1
        tiers = self.block_manager.tiers
        loading = tiers is not None and tiers.num_loading  # disk reads still running: a wait, not a stall
        if not out.scheduled and not out.preempted and not out.tier_copies and not loading and self.has_unfinished():
            bm = self.block_manager
            raise SchedulerStallError(
                f"nothing could be scheduled with {len(self.waiting)} waiting, {len(self.running)} running and "
                f"{len(self.swapped)} swapped sequences, {bm.num_free_blocks} of {bm.num_blocks} blocks free"
            )
        return out

    def _schedule_running(self, out: SchedulerOutput, decodes: list, prefills: list, budget: int) -> int:
        """Step 1: the running sequences' next tokens, preempting victims when the pool runs short; budget left.

        Decodes go before prefill chunks, so a long chunked prefill cannot take the whole token
        budget from them. The victim is the most victim-like sequence (by policy) not yet
        scheduled in this step.
        """
        cfg = self.config
        bm = self.block_manager
        keep_order = sorted(self.running, key=self._keep_key, reverse=True)  # most victim-like last
        queue = deque([s for s in keep_order if s.num_uncomputed_tokens == 1]
                      + [s for s in keep_order if s.num_uncomputed_tokens != 1])
        candidates = list(keep_order)
        requester = cfg.victim_policy is VictimPolicy.REQUESTER
        still_running: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            candidates.remove(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0 or len(decodes) + len(prefills) >= cfg.max_num_seqs:
                still_running.append(seq)
                continue
            while (copies := bm.try_schedule(seq.seq_id, seq.num_computed_tokens, num_new)) is None:
                if candidates and not requester:
                    victim = candidates.pop()
                    queue.remove(victim)
                else:
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.block_copies.extend(copies)
            item = ScheduledSequence(seq, seq.num_computed_tokens, num_new)
            (decodes if item.is_decode else prefills).append(item)
            budget -= num_new
            still_running.append(seq)
        self.running = still_running
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, decodes: list, prefills: list, budget: int) -> int:
        """Step 2: swapped sequences back in, FIFO, while the pool and the budget allow; budget left."""
        cfg = self.config
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.swapped[0]
            if seq.num_pending:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            # Blocks for what comes back plus this step's new tokens (not "+1": a forked
            # sequence may have been swapped out holding the whole pool).
            need = bm.blocks_to_resume(seq.seq_id, seq.num_computed_tokens + num_new)
            watermark = cfg.watermark if self.running else 0.0
            if not bm.can_admit(need, watermark):
                break
            self.swapped.popleft()
            out.swap_in.extend(bm.swap_in(seq.seq_id))
            self.stats.num_swap_ins += 1
            out.block_copies.extend(bm.schedule(seq.seq_id, seq.num_computed_tokens, num_new))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            item = ScheduledSequence(seq, seq.num_computed_tokens, num_new)
            (decodes if item.is_decode else prefills).append(item)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, decodes: list, prefills: list, budget: int) -> None:
        """Step 3: waiting sequences admitted in order while the watermark and the budget hold.

        A prompt whose prefix is being loaded from disk keeps its place but is passed over until it is in host
        memory: the prompts behind it are admitted meanwhile, rather than waiting for its reads."""
        index = 0
        while index < len(self.waiting) and budget > 0:
            seq = self.waiting[index]
            if seq.num_pending:
                break  # its last token is still on the device: admit it once that comes back
            # A request that will fork into n sequences needs room for all of them.
            will_fork = seq.sample_index == 0 and seq.num_output_tokens == 0
            if len(self.running) + (seq.sampling_params.n if will_fork else 1) > self.config.max_num_seqs:
                break
            self._hash_prompt(seq)
            if self._waits_for_disk(seq):
                index += 1
                continue
            item = self._try_admit(seq, budget, out)
            if item is None:
                break
            del self.waiting[index]
            self.running.append(seq)
            if item.num_new_tokens:  # else its blocks are being restored beside this step: it computes from the next
                (decodes if item.is_decode else prefills).append(item)
                budget -= item.num_new_tokens

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Record a finished step whose sampled tokens are known: `advance` then `resolve`.

        `sampled` maps seq id -> new token for every scheduled sequence whose chunk reached
        its last token. A list of n tokens is the first sample of an n > 1 request: the sequence
        keeps the first and forks n - 1 children (listed in `out.forked`) that share its blocks
        and take one token each. Returns the sequences that finished in this step.
        """
        return self.advance(out) + self.resolve(out, sampled)

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """The step is launched: computed tokens move on, and each sampling sequence gets a pending token.

        With async scheduling the engine schedules the next step before this one's tokens are
        known, so only what does not depend on token values happens here: progress, block
        commits up to the first unknown token, and finishing by length (max_tokens or
        max_model_len). Returns the sequences that finished by length.
        """
        finished = []
        bm = self.block_manager
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished while the step ran
            seq.num_computed_tokens = item.end
            bm.commit(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens, seq.first_pending_index),
                      seq.block_hashes)
            if self._has_windows:
                bm.release_out_of_window(seq.seq_id, item.end)
            if item.end != seq.num_tokens:
                continue  # a prefill chunk short of the prompt's end samples nothing
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending += 1
            if seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                if seq in self.running:
                    self.running.remove(seq)
                self._finish(seq, FinishReason.LENGTH)  # its pending token is its last, and is kept
                finished.append(seq)
        return finished

    def resolve(self, out: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """The step's tokens are known: fill the pending tokens, fork n > 1 requests, finish on EOS or stop ids.

        A sequence may have moved on since `advance` (scheduled again, preempted, or finished by
        length); its oldest pending token is this step's either way. Returns the sequences that
        finished here (not those `advance` finished by length).

        NOTE: one request's failure is its own. An exception while resolving a sequence fails
        its whole request (recorded in `out.failed`, every sequence of it finished with ERROR and
        its blocks freed); the step's other sequences are resolved as if nothing happened.
        """
        finished: list[Sequence] = []
        for item in list(out.scheduled):
            seq = item.seq
            if seq.request_id in out.failed:
                continue
            token = sampled.get(seq.seq_id)
            if token is None or seq.num_pending == 0:
                continue  # sampled nothing, or aborted/stopped since (its pending tokens were dropped)
            try:
                finished.extend(self._resolve_one(seq, token, out))
            except Exception as error:  # noqa: BLE001 - contained to this request (see NOTE)
                self.fail_request(seq.request_id, error, out)
        return [seq for seq in finished if seq.request_id not in out.failed]

    def _resolve_one(self, seq: Sequence, token: int | list[int], out: SchedulerOutput) -> list[Sequence]:
        """Fill `seq`'s oldest pending token (forking first when `token` is a list); the sequences it finished."""
        finished = []
        index = seq.first_pending_index
        if isinstance(token, list):
            for sample_index, extra in enumerate(token[1:], start=1):
                child = self._fork(seq, index, extra, sample_index, out)
                if child.is_finished:
                    finished.append(child)
            token = token[0]
        seq.token_ids[index] = token
        seq.num_pending -= 1
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.commit(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens, seq.first_pending_index),
                                      seq.block_hashes)
        stop = self._token_stop(seq, token, index)
        if stop is None:
            return finished
        if seq.is_finished:
            seq.finish_reason = stop  # finished by length at advance; the last token also stops it
        else:
            del seq.token_ids[index + 1:]  # later pending tokens belong to steps past the stop
            seq.num_pending = 0
            self.finish(seq, stop)
            finished.append(seq)
        return finished

    def _fork(self, parent: Sequence, index: int, token: int, sample_index: int, out: SchedulerOutput) -> Sequence:
        """Sample `sample_index` of `parent`'s request: the parent's tokens before `index`, then `token`.

        A running parent's child shares all its blocks (parallel sampling; a write into the
        shared partial block copies it first). A parent that already finished (max_tokens or
        max_model_len reached by this very token) has no blocks left: its child finishes at
        once, holding none. A child that stops on its first token (EOS, a stop id) finishes too.
        """
        child = Sequence(next(self.seq_ids), parent.request_id, parent.prompt_token_ids, parent.sampling_params,
                         parent.arrival_index, priority=parent.priority, sample_index=sample_index,
                         token_ids=parent.token_ids[:index] + [token], group_id=parent.group_id, seed=parent.seed)
        child.num_computed_tokens = parent.num_computed_tokens
        out.forked.append(child)  # listed first: a failure below still finds it (fail_request frees it)
        reason = self._stop_reason(child, token)
        if parent.is_finished:
            child.status = SequenceStatus.FINISHED
            child.finish_reason = reason or parent.finish_reason
            return child
        if parent.status is not SequenceStatus.RUNNING:
            raise AssertionError(f"{parent} forks while {parent.status.value}: n > 1 requests resolve in their step")
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        if reason is not None:
            self.finish(child, reason)
        return child

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
    def _hash_prompt(self, seq: Sequence) -> None:
        """The prefix-cache keys of `seq`'s full blocks, computed once per sequence (or never, when the router sent
        them), not per admission attempt."""
        block_size = self.config.block_size
        num_full = seq.first_pending_index // block_size
        if self.block_manager.prefix_cache is not None and len(seq.block_hashes) < num_full:
            seq.block_hashes = block_keys(seq.token_ids[:seq.first_pending_index], block_size, seq.block_hashes)

    def _waits_for_disk(self, seq: Sequence) -> bool:
        """Whether `seq`'s prefix is being loaded from disk (starting the loads it needs): it waits for them."""
        bm = self.block_manager
        return (bm.prefix_cache is not None and self.config.reservation != "naive"
                and bm.prefetch(seq.token_ids, seq.block_hashes))

    def _try_admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledSequence | None:
        """Admit `seq` with its first chunk, or return None when the pool or the budget holds it back."""
        cfg = self.config
        bm = self.block_manager
        reserve = cfg.max_model_len if cfg.reservation == "naive" else None
        new_blocks = bm.blocks_to_admit(seq.token_ids, reserve, seq.block_hashes)
        # Alone in the pool, a request may use the reserve: holding it back could only stall.
        watermark = cfg.watermark if self.running or self.swapped else 0.0
        if not bm.can_admit(new_blocks, watermark):
            return None
        num_cached = bm.admit(seq.seq_id, seq.token_ids, reserve, seq.block_hashes)
        num_new = seq.num_tokens - num_cached
        if bm.is_restoring(seq.seq_id):
            num_new = 0  # it waits for its restored blocks (see the module docstring)
        elif num_new > budget:
            if not cfg.enable_chunked_prefill:
                bm.free(seq.seq_id)
                return None
            num_new = budget
        # Slots for the whole uncomputed part now, so later chunks cannot run short.
        out.block_copies.extend(bm.append_slots(seq.seq_id, seq.num_tokens - bm.num_tokens(seq.seq_id)))
        out.block_copies.extend(bm.schedule(seq.seq_id, num_cached, num_new))  # sliding groups: the first chunk
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        return ScheduledSequence(seq, num_cached, num_new)

    def _keep_key(self, seq: Sequence):
        """Sort key: larger = keep longer (scheduled first, preempted last)."""
        policy = self.config.victim_policy
        if policy is VictimPolicy.PRIORITY:
            return (seq.priority, -seq.arrival_index)
        if policy is VictimPolicy.CHEAPEST:
            return (seq.num_computed_tokens, -seq.arrival_index)
        return (-seq.arrival_index,)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free `seq`'s GPU blocks: swap it out if swap mode has room for it, else recompute it later."""
        bm = self.block_manager
        self.stats.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode is PreemptionMode.SWAP and bm.can_swap_out(seq.seq_id):
            out.swap_out.extend(bm.swap_out(seq.seq_id))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.stats.num_swap_outs += 1
            return
        bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_recomputes += 1

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why `seq`, whose last token is `token`, stops now (None: it goes on)."""
        params = seq.sampling_params
        if self._token_stop(seq, token, len(seq.token_ids) - 1) is not None:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _token_stop(self, seq: Sequence, token: int, index: int) -> FinishReason | None:
        """STOP if `token`, at position `index`, is EOS or a stop token id (and min_tokens are out), else None."""
        params = seq.sampling_params
        if index + 1 - seq.num_prompt_tokens <= params.min_tokens:
            return None
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return FinishReason.STOP
        return None

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
