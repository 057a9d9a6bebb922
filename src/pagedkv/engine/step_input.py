"""The step input: everything the model runner needs for one step, as plain data.

The scheduler decides *what* runs (`SchedulerOutput`, which points at live `Sequence`
objects and the block manager). `StepInputBuilder` turns that into a `StepInput` of ints,
lists and frozen `SamplingParams`: no callbacks, no references into scheduler state. It can
be pickled and sent to another process, which is how tensor-parallel workers receive the
same step as rank 0.

Token layout (decode rows first, then prefill chunks, as the scheduler orders them):

    | decode tokens (1 per seq) | chunk of seq d | chunk of seq d+1 | ... |
    0                   num_decode_seqs                            num_tokens

A model with layer groups (sliding-window layers, `pagedkv.core.kv_groups`) has one table per
group per sequence: group 0's slots are `slot_mapping`, group g's are `group_slot_mapping[g - 1]`,
and group g's table rows sit at `g * (num_table_rows + 1) + row` of the device tables, so one
list of updates serves every group.

Block tables stay on the device between steps, one persistent row per running sequence
(`TableRows`). A step carries only the rows that changed: a sequence new to the device gets
its whole table, a sequence that grew gets its new blocks, and a copy-on-write replaces the
last entry. A decode step of 256 sequences typically uploads ~16 block ids, not 256 tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedkv.engine.sampler import SamplingRow
from pagedkv.engine.scheduler_types import SchedulerOutput
from pagedkv.engine.sequence import PENDING_TOKEN


@dataclass
class StepInput:
    """One step for the runner. Lists are per token, per scheduled sequence or per sampling row."""

    input_ids: list[int] = field(default_factory=list)  # [num_tokens]
    positions: list[int] = field(default_factory=list)  # [num_tokens]
    slot_mapping: list[int] = field(default_factory=list)  # [num_tokens] pool slot of each token's K/V
    table_rows: list[int] = field(default_factory=list)  # [num_seqs] persistent block-table row of each seq
    seq_lens: list[int] = field(default_factory=list)  # [num_seqs] kv length after this step
    query_lens: list[int] = field(default_factory=list)  # [num_seqs] tokens of each seq in this step
    num_decode_seqs: int = 0
    # (row, first column, block ids): the persistent table rows this step changes
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # (token index, sampling row of the previous step): input tokens still on the device (async
    # scheduling); the runner copies them from the previous step's sampled tokens
    pending_inputs: list[tuple[int, int]] = field(default_factory=list)
    sample_seqs: list[int] = field(default_factory=list)  # [num_sampling_rows] index into the scheduled seqs
    sampling: list[SamplingRow] = field(default_factory=list)  # [num_sampling_rows]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, CPU block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, GPU block)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), copy-on-write
    # KV tiers (see pagedkv.core.kv_tiers): spills, prefix restores, disk reads/writes/deletes
    offload: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, host block)
    pre_offload: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, host block), beside the step
    restore: list[tuple[int, int]] = field(default_factory=list)  # (host block, GPU block), beside the step
    restore_in_step: list[tuple[int, int]] = field(default_factory=list)  # (host block, GPU block), before it
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)  # (key, host block)
    disk_writes: list[tuple[bytes, int]] = field(default_factory=list)  # (key, host block)
    disk_deletes: list[bytes] = field(default_factory=list)  # keys
    # shutdown: write these cached blocks to disk now, (key, GPU block) and (key, host block), on every rank
    persist: list[tuple[bytes, int]] = field(default_factory=list)
    persist_host: list[tuple[bytes, int]] = field(default_factory=list)
    persist_order: list[bytes] = field(default_factory=list)  # then: every disk key, least recently used first
    group_slot_mapping: list[list[int]] = field(default_factory=list)  # [num_groups - 1][num_tokens], groups 1..

    def for_workers(self) -> StepInput:
        """This step as tensor-parallel workers need it: without the sampling rows (rank 0 samples).

        A shallow copy; at batch 256 the sampling rows are ~90% of the pickled step and of its
        (un)pickling time.
        """
        return replace(self, sampling=[])

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.num_seqs > 0 and self.num_decode_seqs == self.num_seqs


class TableRows:
    """Which persistent device row holds which sequence's block table, and what the device has of it.

    Pure bookkeeping. A sequence's table is the `BlockTable` object the block manager holds;
    its list of ids only ever grows at the end or has its last entry replaced (copy-on-write),
    and a preempted sequence gets a new `BlockTable` object when it comes back. So comparing
    (object, length, last id) with what was uploaded finds every change in O(1).
    """

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: dict[int, list] = {}  # seq id -> [row, table object, uploaded length, last uploaded id]

    def sync(self, seq_id: int, table, live_seq_ids) -> tuple[int, tuple[int, int, list[int]] | None]:
        """(row of `seq_id`, the update to apply or None); claims a row for a sequence new to the device."""
        ids = table.block_ids
        entry = self._rows.get(seq_id)
        if entry is None or entry[1] is not table:
            row = entry[0] if entry is not None else self._claim(live_seq_ids)
            self._rows[seq_id] = [row, table, len(ids), ids[-1] if ids else None]
            return row, ((row, 0, list(ids)) if ids else None)
        row, _, uploaded, last = entry
        if len(ids) == uploaded and (not ids or ids[-1] == last):  # the common case, inline: nothing changed
            return row, None
        return row, self._diff(entry, ids)

    def follow(self, seq_id: int, row: int, table) -> tuple[int, int, list[int]] | None:
        """The update of `seq_id`'s table in another layer group, kept at `row` (its group-0 row); or None."""
        ids = table.block_ids
        entry = self._rows.get(seq_id)
        if entry is None or entry[1] is not table or entry[0] != row:
            self._rows[seq_id] = [row, table, len(ids), ids[-1] if ids else None]
            return (row, 0, list(ids)) if ids else None
        if len(ids) == entry[2] and (not ids or ids[-1] == entry[3]):  # the common case, inline: nothing changed
            return None
        return self._diff(entry, ids)

    @staticmethod
    def _diff(entry: list, ids: list[int]) -> tuple[int, int, list[int]] | None:
        """What changed since the last upload: ids only grow at the end or have their last entry replaced.

        (A sliding group's entries that fell out of the window turn into the null block; the
        device keeps the old ids there, which no kernel reads.)
        """
        row, _, uploaded, last = entry
        num = len(ids)
        if num == uploaded and (not num or ids[-1] == last):
            return None
        first = uploaded - 1 if uploaded and ids[uploaded - 1] != last else uploaded
        first = min(first, num)
        entry[2], entry[3] = num, ids[-1] if ids else None
        return (row, first, ids[first:]) if first < num else None

    def release(self, seq_id: int) -> None:
        entry = self._rows.pop(seq_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def _claim(self, live_seq_ids) -> int:
        if not self._free:
            # Reclaim rows of sequences that left without an explicit release (finished, aborted).
            for seq_id in [s for s in self._rows if s not in live_seq_ids]:
                self.release(seq_id)
        if not self._free:
            raise RuntimeError(f"all {self.num_rows} block-table rows are held by live sequences")
        return self._free.pop()


class StepInputBuilder:
    """Builds `StepInput`s from scheduler outputs; owns the persistent-row bookkeeping."""

    def __init__(self, block_manager, block_size: int, num_table_rows: int):
        self.block_manager = block_manager
        self.block_size = block_size
        self.rows = TableRows(num_table_rows)
        # Groups 1.. follow group 0's rows; their device rows are offset by a whole table per group.
        self.group_rows = [TableRows(num_table_rows) for _ in range(block_manager.num_groups - 1)]
        self.row_stride = num_table_rows + 1

    def release(self, seq_id: int) -> None:
        """A sequence left the device (finished, aborted or preempted): its row can be reused."""
        self.rows.release(seq_id)
        for rows in self.group_rows:
            rows.release(seq_id)

    def build(self, out: SchedulerOutput, live_seq_ids, num_samples: dict[int, int] | None = None,
              previous_rows: dict[int, int] | None = None) -> StepInput:
        """The runner's input for `out`. `num_samples[seq_id] = n` asks for n samples from one row.

        `previous_rows` maps seq id -> sampling row of the step still in flight, for decode
        inputs that are that step's (still unknown) tokens.
        """
        for seq in out.preempted:
            self.release(seq.seq_id)
        tiers = out.tier_copies
        step = StepInput(
            swap_out=[(c.src, c.dst) for c in out.swap_out],
            swap_in=[(c.src, c.dst) for c in out.swap_in],
            block_copies=[(c.src, c.dst) for c in out.block_copies],
            offload=[(c.src, c.dst) for c in tiers.offload],
            pre_offload=[(c.src, c.dst) for c in tiers.pre_offload],
            restore=[(c.src, c.dst) for c in tiers.restore],
            restore_in_step=[(c.src, c.dst) for c in tiers.restore_in_step],
            disk_loads=tiers.disk_loads, disk_writes=tiers.disk_writes, disk_deletes=tiers.disk_deletes,
        )
        bm = self.block_manager
        block_size = self.block_size
        input_ids, positions, slots = step.input_ids, step.positions, step.slot_mapping
        table_rows, seq_lens, query_lens, updates = step.table_rows, step.seq_lens, step.query_lens, step.table_updates
        num_decode = 0
        for index, item in enumerate(out.scheduled):
            seq = item.seq
            start, end = item.start, item.start + item.num_new_tokens
            table = bm.table(seq.seq_id)
            row, update = self.rows.sync(seq.seq_id, table, live_seq_ids)
            if update is not None:
                updates.append(update)
            block_ids = table.block_ids
            if end - start == 1:
                num_decode += 1
                token = seq.token_ids[start]
                if token == PENDING_TOKEN:
                    step.pending_inputs.append((len(input_ids), previous_rows[seq.seq_id]))
                    token = 0
                input_ids.append(token)
                positions.append(start)
                slots.append(block_ids[start // block_size] * block_size + start % block_size)
            else:
                assert seq.first_pending_index >= end, f"a prefill chunk of {seq} reads a pending token"
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                pos = start
                while pos < end:  # one run of slots per block the chunk touches
                    block_end = min(end, (pos // block_size + 1) * block_size)
                    base = block_ids[pos // block_size] * block_size - (pos // block_size) * block_size
                    slots.extend(range(base + pos, base + block_end))
                    pos = block_end
            table_rows.append(row)
            seq_lens.append(end)
            query_lens.append(end - start)
            if end == seq.num_tokens:  # this chunk reaches the last token: the step samples
                step.sample_seqs.append(index)
                params = seq.sampling_params
                count = (num_samples or {}).get(seq.seq_id, 1)
                history = params.needs_history
                step.sampling.append(SamplingRow(
                    params=params, seed=seq.seed,
                    sample_indices=tuple(range(count)) if count > 1 else (seq.sample_index,),
                    num_output_tokens=seq.num_output_tokens,
                    prompt_token_ids=seq.prompt_token_ids if history else (),
                    output_token_ids=seq.output_token_ids if history else (),
                ))
        step.num_decode_seqs = num_decode
        if self.group_rows:
            self._add_groups(out, step)
        return step

    def _add_groups(self, out: SchedulerOutput, step: StepInput) -> None:
        """Slots and table-row updates of layer groups 1.. (their rows are group 0's, offset per group)."""
        bm = self.block_manager
        block_size = self.block_size
        group_table = bm.group_table
        updates = step.table_updates
        for g, rows in enumerate(self.group_rows, start=1):
            slots: list[int] = []
            offset = g * self.row_stride
            follow = rows.follow
            for item, row in zip(out.scheduled, step.table_rows):
                seq_id = item.seq.seq_id
                table = group_table(seq_id, g)
                update = follow(seq_id, row, table)
                if update is not None:
                    updates.append((offset + update[0], update[1], update[2]))
                block_ids = table.block_ids
                start = item.start
                if item.num_new_tokens == 1:  # a decode: one slot (most items of most steps)
                    slots.append(block_ids[start // block_size] * block_size + start % block_size)
                else:
                    slots.extend(block_ids[pos // block_size] * block_size + pos % block_size
                                 for pos in range(start, start + item.num_new_tokens))
            step.group_slot_mapping.append(slots)
