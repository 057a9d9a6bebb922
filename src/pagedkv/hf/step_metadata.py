"""A `PagedCache` step's attention metadata, packed into one host-to-device copy.

Every kernel input of a step (slot mapping, sequence lengths, query offsets, block tables)
and the step's copy-on-write block pairs travel as segments of one int64 buffer, copied to
the device at once; the metadata's tensors are views of it. The copy-on-write copies run on
the device right after, before any layer writes K/V, so a row never writes into a block it
shares.
"""

from __future__ import annotations

import torch

from pagedkv.core.block_table import BlockCopy, BlockTable
from pagedkv.hf.attention import PagedAttentionMetadata
from pagedkv.kernels import KVPool

#: The narrowest block-table width of a decode step's metadata (256 tokens at 16-token pages).
_MIN_TABLE_WIDTH = 16


def _align(packed: list[int]) -> None:
    """Pad `packed` to an even length: the next int64 segment starts on 16 bytes."""
    if len(packed) & 1:
        packed.append(0)



class _HostStaging:
    """The per-step metadata's way to the device: one host buffer, one device buffer, one copy.

    On CUDA both buffers are made once (and regrown, doubling, when a step needs more), so a
    step allocates nothing. The host buffer is pinned, so the copy is truly asynchronous: a
    copy from pageable memory makes the host wait for the stream, i.e. for every kernel queued
    before it. An event guards the host buffer's reuse (the previous step's copy is long done
    by then: generate reads its tokens back every step). The device buffer needs no guard: the
    copy into it is queued on the stream behind every kernel that read the previous step's.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None  # pinned int64 buffer (CUDA only)
        self._host_values = None  # a numpy view of it: filling it from a list is one C loop
        self._on_device: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def to_device(self, values: list[int]) -> torch.Tensor:
        """`values` as an int64 tensor on the device (without waiting for the device on CUDA).

        On CUDA the result is a view of the reused device buffer: valid until the next call.
        """
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.int64, device=self.device)
        n = len(values)
        if self._host is None or self._host.numel() < n:
            # A dropped buffer stays alive until its pending copy ends (the caching allocators track both).
            capacity = max(4096, 2 * n)
            self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            self._host_values = self._host.numpy()
            self._on_device = torch.empty(capacity, dtype=torch.int64, device=self.device)
            self._copied = torch.cuda.Event()
        else:
            self._copied.synchronize()
        self._host_values[:n] = values
        on_device = self._on_device[:n]
        on_device.copy_(self._host[:n], non_blocking=True)
        self._copied.record()  # on the current stream, where the copy was queued
        return on_device


class StepMetadataPacker:
    """One cache's way from its block tables to a step's `PagedAttentionMetadata` on the device.

    It holds what outlives a step: the staging buffers and the decode table width, which only grows.
    """

    def __init__(self, pool: KVPool):
        self.pool = pool
        self._staging = _HostStaging(pool.device)
        self._table_width = _MIN_TABLE_WIDTH  # block-table columns of a decode step's metadata; only grows

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy each (src, dst) block pair now, every layer's K and V at once (outside a step's packed copy)."""
        if copies:
            src = torch.tensor([c.src for c in copies], device=self.pool.device)
            dst = torch.tensor([c.dst for c in copies], device=self.pool.device)
            self.pool.kv_storage.index_copy_(2, dst, self.pool.kv_storage.index_select(2, src))

    def _copy_on_write(self, on_device: torch.Tensor, copies_at: int, num_copies: int) -> None:
        """Copy each (src, dst) block pair packed at `copies_at` (srcs, then dsts), every layer's K and V at once."""
        if num_copies:
            kv = self.pool.kv_storage  # [2, L, N, B, Hkv, D]: one block id addresses every layer's K and V
            src = on_device[copies_at:copies_at + num_copies]
            dst = on_device[copies_at + num_copies:copies_at + 2 * num_copies]
            kv.index_copy_(2, dst, kv.index_select(2, src))

    def pack_decode(self, tables: list[BlockTable], copies: list[BlockCopy], decode_kernel) -> PagedAttentionMetadata:
        """A decode step's metadata for the fused kernel `decode_kernel`, in one host-to-device copy:

            | seq_lens (batch) | cow src | cow dst | block tables (batch x width) |

        every segment starting on 16 bytes. No slot mapping: the kernel finds the new token's
        slot through the block table. The table width is a power of two that only grows, so
        its stride, one of the kernel's launch arguments, changes a few times in a generation
        instead of every block_size tokens (each change is one launch through Triton per
        configuration; the rest replay the bound launch).
        """
        batch = len(tables)
        packed = [table.num_tokens for table in tables]
        max_len = max(packed)
        max_blocks = max([len(table.block_ids) for table in tables])
        width = self._table_width
        if max_blocks > width:
            width = self._table_width = 1 << (max_blocks - 1).bit_length()
        _align(packed)
        copies_at = len(packed)
        packed += [c.src for c in copies]
        packed += [c.dst for c in copies]
        _align(packed)
        tables_at = len(packed)
        padding = [0] * width
        for table in tables:
            block_ids = table.block_ids
            packed += block_ids
            packed += padding[len(block_ids):]
        on_device = self._staging.to_device(packed)
        self._copy_on_write(on_device, copies_at, len(copies))
        seq_lens = on_device[:batch]
        block_tables = on_device[tables_at:tables_at + batch * width].view(batch, width)
        return PagedAttentionMetadata(None, batch, block_tables, seq_lens, max_len, None, None, None, 0, 0, None,
                                      decode_kernel.step(block_tables, seq_lens, max_len))

    def pack(self, tables: list[BlockTable], num_new: list[int] | None, q_len: int, copies: list[BlockCopy],
             token_index: torch.Tensor | None) -> PagedAttentionMetadata:
        """The step's metadata in one host-to-device copy; performs the copy-on-write copies first.

        `num_new[row]` is the row's new tokens (None: every row gains `q_len`), `token_index` the
        non-pad positions of the flattened `[batch, q_len]` input (None: no pads).
        """
        batch = len(tables)
        block_size = self.pool.block_size
        slots: list[int] = []
        seq_lens: list[int] = []
        if q_len == 1:
            for table in tables:
                position = table.num_tokens - 1
                slots.append(table.block_ids[position // block_size] * block_size + position % block_size)
                seq_lens.append(position + 1)
        else:
            for row, table in enumerate(tables):
                n = q_len if num_new is None else num_new[row]
                slots += table.slot_mapping(table.num_tokens - n, table.num_tokens)
                seq_lens.append(table.num_tokens)
        max_blocks = max(1, max((table.num_blocks for table in tables), default=0))
        # [slots | seq_lens | cu_seqlens_q (prefill) | cow src | cow dst | block tables], every kernel input
        # starting on 16 bytes: Triton specializes pointers on that alignment, so a shifting offset would
        # compile (and cache) another variant of the kernel mid-generation.
        num_slots = len(slots)
        packed = slots  # grown in place from here on
        _align(packed)
        seq_lens_at = len(packed)
        packed += seq_lens
        _align(packed)
        cu_at = len(packed)
        if q_len > 1:
            cu = 0
            packed.append(0)
            for row in range(batch):
                cu += q_len if num_new is None else num_new[row]
                packed.append(cu)
            _align(packed)
        copies_at = len(packed)
        num_copies = len(copies)
        packed += [c.src for c in copies]
        packed += [c.dst for c in copies]
        _align(packed)
        tables_at = len(packed)
        for table in tables:
            packed += table.block_ids
            if table.num_blocks < max_blocks:
                packed += [0] * (max_blocks - table.num_blocks)
        on_device = self._staging.to_device(packed)
        self._copy_on_write(on_device, copies_at, num_copies)
        slot_mapping = on_device[:num_slots]
        seq_lens_t = on_device[seq_lens_at:seq_lens_at + batch]
        block_tables = on_device[tables_at:tables_at + batch * max_blocks].view(batch, max_blocks)
        max_len = max(seq_lens, default=0)
        if q_len == 1:
            return PagedAttentionMetadata(slot_mapping, batch, block_tables, seq_lens_t, max_len,
                                          None, None, None, 0, 0, token_index)
        cu_seqlens_q = on_device[cu_at:cu_at + batch + 1]
        max_seqlen_q = q_len if num_new is None else max(num_new)
        return PagedAttentionMetadata(slot_mapping, 0, None, None, 0, block_tables, seq_lens_t, cu_seqlens_q,
                                      max_seqlen_q, max_len, token_index)


__all__ = ["StepMetadataPacker"]
