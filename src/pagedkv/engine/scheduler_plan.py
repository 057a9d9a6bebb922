"""Planning one scheduler step: which running, swapped and waiting sequences run, and who is preempted.

`StepPlanner` is the half of `Scheduler` (engine/scheduler.py) that `schedule()` runs; it reads
and changes the scheduler's queues, block manager and stats. Pure Python, no torch.

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

from collections import deque

from pagedkv.core.prefix_cache import block_keys
from pagedkv.engine.scheduler_types import PreemptionMode, ScheduledSequence, SchedulerOutput, VictimPolicy
from pagedkv.engine.sequence import Sequence, SequenceStatus
from pagedkv.errors import SchedulerStallError


class StepPlanner:
    """`schedule()` and its parts; mixed into `Scheduler`, which owns the queues and the block manager."""

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
