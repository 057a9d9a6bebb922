"""The model runner: turns one `SchedulerOutput` into one model call and its sampled tokens.

All scheduled tokens of a step go into one flat batch (decode rows first, prefill chunks
after), with the field's metadata:

    input_ids, positions      [num_tokens]
    slot_mapping              [num_tokens]      where each token's K/V is written
    block_tables, seq_lens    [num_seqs, ...]   what each sequence attends to
    cu_seqlens_q              [num_prefill + 1] where each prefill chunk starts

The HF model runs once over `[1, num_tokens]`, its attention routed through
`pagedkv.hf.attention` by a per-step paged cache. Device inputs live in buffers allocated
once at their largest size and refilled each step, and nothing inside the model call reads
a device value back to the host: the shape decode steps need to be captured in CUDA
graphs later. Logits are computed only for the rows that sample.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.core.block_table import BlockCopy
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.hf.attention import PagedAttentionMetadata
from pagedkv.hf.cache import PagedKVCacheBase
from pagedkv.kernels import KVPool


class StepCache(PagedKVCacheBase):
    """The `past_key_values` the runner passes: it serves the metadata the runner prepared for this step."""

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.prepared: PagedAttentionMetadata | None = None

    def _build_metadata(self, attention_mask, batch: int, q_len: int) -> PagedAttentionMetadata:
        return self.prepared

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are passed explicitly


class ModelRunner:
    """Owns the model, the KV pool tensors, the CPU swap space and the sampler."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, *, num_swap_blocks: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_blocks_per_seq: int, seed: int):
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.sampler = Sampler(seed, self.device)
        self.step_cache = StepCache(pool)
        pin = self.device.type == "cuda"
        self.swap_kv = None
        if num_swap_blocks:
            shape = (2, pool.num_layers, num_swap_blocks, pool.block_size, pool.num_kv_heads, pool.head_dim)
            self.swap_kv = torch.zeros(shape, dtype=pool.dtype, pin_memory=pin)
        max_rows = max(max_num_seqs, 1)
        self.max_blocks_per_seq = max_blocks_per_seq
        device = self.device
        # Static device buffers (filled in place each step).
        self.input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.sample_rows = torch.zeros(max_rows, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ block movement
    def swap_out(self, copies: list[BlockCopy]) -> None:
        """Copy GPU blocks to CPU swap blocks (before the GPU blocks are reused)."""
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies])
        k, v = self.pool.gather_blocks(src)
        self.swap_kv[0][:, dst] = k.to("cpu")
        self.swap_kv[1][:, dst] = v.to("cpu")

    def swap_in(self, copies: list[BlockCopy]) -> None:
        """Copy CPU swap blocks back into GPU blocks."""
        if not copies:
            return
        src = torch.tensor([c.src for c in copies])
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        self.pool.scatter_blocks(dst, self.swap_kv[0][:, src], self.swap_kv[1][:, src])

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write: duplicate shared blocks before one of their sharers writes."""
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        self.pool.copy_blocks(src, dst)

    # ------------------------------------------------------------------ one step
    def prepare(self, out: SchedulerOutput, block_ids_of) -> tuple[PagedAttentionMetadata, int, list[int]]:
        """Fill the static buffers for this step; returns (metadata, num_tokens, flat index of each sampling row)."""
        block_size = self.pool.block_size
        scheduled = out.scheduled
        num_tokens = out.num_batched_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        num_seqs = len(scheduled)
        max_blocks = 1
        tables = []
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        cu = np.zeros(num_seqs + 1, dtype=np.int32)
        sample_rows: list[int] = []
        offset = 0
        for i, item in enumerate(scheduled):
            seq, start, end = item.seq, item.start, item.end
            n = end - start
            input_ids[offset:offset + n] = seq.token_ids[start:end]
            positions[offset:offset + n] = np.arange(start, end)
            block_ids = block_ids_of(seq.seq_id)
            table = np.asarray(block_ids, dtype=np.int64)
            pos = positions[offset:offset + n]
            slots[offset:offset + n] = table[pos // block_size] * block_size + pos % block_size
            tables.append(block_ids)
            max_blocks = max(max_blocks, len(block_ids))
            seq_lens[i] = end
            offset += n
            cu[i + 1] = offset
            if item.samples:
                sample_rows.append(offset - 1)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, block_ids in enumerate(tables):
            block_tables[i, :len(block_ids)] = block_ids

        self.input_ids[:num_tokens].copy_(torch.from_numpy(input_ids), non_blocking=True)
        self.positions[:num_tokens].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(torch.from_numpy(slots), non_blocking=True)
        self.block_tables[:num_seqs, :max_blocks].copy_(torch.from_numpy(block_tables), non_blocking=True)
        self.seq_lens[:num_seqs].copy_(torch.from_numpy(seq_lens), non_blocking=True)

        nd = out.num_decode_seqs  # decodes come first: rows [0, nd) have one token each
        max_decode_len = int(seq_lens[:nd].max()) if nd else 0
        num_prefill = num_seqs - nd
        prefill_cu = cu[nd:] - cu[nd]
        self.cu_seqlens_q[:num_prefill + 1].copy_(torch.from_numpy(prefill_cu), non_blocking=True)
        chunk_lens = np.diff(prefill_cu)
        meta = PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            num_decode_tokens=nd,
            decode_block_tables=self.block_tables[:nd, :max_blocks] if nd else None,
            decode_seq_lens=self.seq_lens[:nd] if nd else None,
            max_decode_seq_len=max_decode_len,
            prefill_block_tables=self.block_tables[nd:num_seqs, :max_blocks] if num_prefill else None,
            prefill_seq_lens=self.seq_lens[nd:num_seqs] if num_prefill else None,
            cu_seqlens_q=self.cu_seqlens_q[:num_prefill + 1] if num_prefill else None,
            max_seqlen_q=int(chunk_lens.max()) if num_prefill else 0,
            max_prefill_seq_len=int(seq_lens[nd:].max()) if num_prefill else 0,
        )
        return meta, num_tokens, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids_of, num_samples: dict[int, int]) -> dict[int, list[int]]:
        """Run one step: block moves, the model, sampling. Returns seq id -> sampled token(s)."""
        self.swap_out(out.swap_out)
        self.swap_in(out.swap_in)
        self.copy_blocks(out.block_copies)
        if not out.scheduled:
            return {}
        meta, num_tokens, sample_rows = self.prepare(out, block_ids_of)
        self.step_cache.prepared = meta
        samplers = [item.seq for item in out.scheduled if item.samples]
        if not samplers:
            self._forward(num_tokens, None)
            return {}
        rows = self.sample_rows[:len(sample_rows)]
        rows.copy_(torch.tensor(sample_rows), non_blocking=True)
        logits = self._forward(num_tokens, rows)[0]  # [num_samplers, vocab]
        params = [seq.sampling_params for seq in samplers]
        # Seeded streams are keyed by (request, sample): a forked child continues the stream
        # its first token came from.
        keys = [(seq.group_id, seq.sample_index) for seq in samplers]
        counts = [num_samples.get(seq.seq_id, 1) for seq in samplers]
        tokens = self.sampler.sample(logits, params, keys, counts)
        return {seq.seq_id: toks for seq, toks in zip(samplers, tokens)}

    def _forward(self, num_tokens: int, logits_rows: torch.Tensor | None) -> torch.Tensor:
        output = self.model(
            input_ids=self.input_ids[:num_tokens].view(1, -1),
            position_ids=self.positions[:num_tokens].view(1, -1),
            past_key_values=self.step_cache,
            use_cache=True,
            logits_to_keep=logits_rows if logits_rows is not None else 1,
        )
        return output.logits
