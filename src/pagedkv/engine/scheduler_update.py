"""Recording a launched scheduler step: progress at launch (`advance`), token values when they are known (`resolve`).

`StepUpdater` is the half of `Scheduler` (engine/scheduler.py) that runs after `schedule()`: it
moves computed tokens on, fills pending tokens, forks the n - 1 siblings of an n > 1 request and
finishes sequences by length, EOS or stop ids. Pure Python, no torch.
"""

from __future__ import annotations

from pagedkv.engine.scheduler_types import SchedulerOutput
from pagedkv.engine.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus


class StepUpdater:
    """`update`, `advance` and `resolve`; mixed into `Scheduler`, which owns the queues and the block manager."""

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
