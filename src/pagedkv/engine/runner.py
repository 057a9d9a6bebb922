"""The model runner: one `StepInput` in, the step's sampled tokens out.

It owns the model, the KV pool's device tensors, the host pool of the KV tiers (which swap
preemption shares, `kv_offload.py`), the attention backend and the sampler. A step is:

1. block moves (spills and swap-outs to host memory, swap-ins and prefix restores from it on
   a side stream; copy-on-write), ordered before any K/V is written;
2. one host-to-device copy: the step's small metadata is packed into a pinned int64 staging
   buffer (two of them, used in turn) and copied as one transfer. Its fixed regions are

       | input_ids | positions | slot_mapping | rows | seq_lens | cu_seqlens_q | logits_indices | updates... |
         max_tokens  max_tokens  max_tokens     max_seqs x 4 (+1)                               2 x changed ids

   so the views a CUDA graph reads never move;
3. the block-table rows that changed are scattered into the persistent tables;
4. the forward: a decode-only step of at most the largest captured batch replays the CUDA
   graph of the next padded batch size (padded rows read nothing and write a scratch slot);
   a step with prefill tokens, up to the largest token bucket, replays the piecewise graphs
   of its padded token count with attention run eagerly between them (`piecewise_graphs`);
   every other step runs eagerly;
5. the sampler, over the logits rows that sample, with one device-to-host copy of its results.

Two model paths share all of this: pagedkv's own Llama-family decoder (`pagedkv.models`),
which takes the attention backend as an argument and can be captured in graphs, and HF's own
modules for every other architecture, reached through the `pagedkv` attention function and a
per-step cache (eager only).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedkv.engine.kv_offload import KVOffload
from pagedkv.engine.piecewise_graphs import (
    CAPTURE_ERROR_MODE,
    PiecewiseGraphs,
    no_collection_during_capture,
    token_buckets,
)
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.step_input import StepInput
from pagedkv.kernels import KVPool
from pagedkv.kernels.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger("pagedkv")


def graph_batch_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top]
    sizes += list(range(16, min(top, 64) + 1, 8)) + list(range(80, top + 1, 16))
    if sizes[-1] < top:
        sizes.append(top)
    return sorted(set(sizes))


class HFModelAdapter:
    """HF modules behind the same call as the own decoder: (input_ids, positions, attn, logits_indices) -> logits."""

    def __init__(self, model: torch.nn.Module, pool: KVPool):
        from pagedkv.hf.attention import PagedAttentionMetadata
        from pagedkv.hf.cache_base import PagedKVCacheBase

        class StepCache(PagedKVCacheBase):
            """Serves the runner's metadata for this step to the `pagedkv` attention function."""

            prepared = None

            def _build_metadata(self, attention_mask, batch, q_len):
                return self.prepared

            def get_seq_length(self, layer_idx: int = 0) -> int:
                return 0  # positions are passed explicitly

        self.model = model
        self.cache = StepCache(pool)
        self._metadata_cls = PagedAttentionMetadata

    def _hf_metadata(self, m: AttentionMetadata):
        return self._metadata_cls(
            slot_mapping=m.slot_mapping, num_decode_tokens=m.num_decode_tokens,
            decode_block_tables=m.decode_block_tables, decode_seq_lens=m.decode_seq_lens,
            max_decode_seq_len=m.max_decode_seq_len, prefill_block_tables=m.prefill_block_tables,
            prefill_seq_lens=m.prefill_seq_lens, cu_seqlens_q=m.cu_seqlens_q, max_seqlen_q=m.max_seqlen_q,
            max_prefill_seq_len=m.max_prefill_seq_len)

    @torch.inference_mode()
    def __call__(self, input_ids, positions, attn, logits_indices):
        self.cache.prepared = self._hf_metadata(attn.meta)
        if attn.layer_metas is not None:  # layer groups: each layer reads its group's tables
            by_group = {id(m): self._hf_metadata(m) for m in attn.meta.group_metas}
            self.cache.prepared.layer_metadata = [by_group[id(m)] for m in attn.layer_metas]
        output = self.model(input_ids=input_ids.view(1, -1), position_ids=positions.view(1, -1),
                            past_key_values=self.cache, use_cache=True,
                            logits_to_keep=logits_indices if logits_indices is not None else 0)
        return output.logits[0]


class ReceivedTokens:
    """What a tensor-parallel worker's step yields: rank 0's sampled first tokens, on the device."""

    def __init__(self, device_tokens: torch.Tensor):
        self.device_tokens = device_tokens


class ModelRunner:
    """Owns the model, the pool tensors, the attention backend, the CUDA graphs and the sampler."""

    def __init__(self, model, pool: KVPool, *, is_own_model: bool, offload: KVOffload | None, max_num_seqs: int,
                 max_num_batched_tokens: int, max_blocks_per_seq: int, num_table_rows: int, max_model_len: int,
                 vocab_size: int, eos_token_ids=(), scratch_slot: int, enforce_eager: bool = False,
                 mixed_step_graphs: str = "full", tp=None, layer_groups: tuple[int, ...] | None = None):
        self.tp = tp  # a TensorParallel group: rank 0 samples and broadcasts the tokens (see _sample)
        self.model = model if is_own_model else HFModelAdapter(model, pool)
        self.is_own_model = is_own_model
        self.pool = pool
        self.device = pool.device
        self.scratch_slot = scratch_slot
        self.sampler = Sampler(vocab_size, self.device, eos_token_ids)
        self.backend = AttentionBackend(pool, max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks_per_seq,
                                        num_table_rows=num_table_rows, max_model_len=max_model_len,
                                        layer_groups=layer_groups)
        num_groups = self.backend.num_groups
        self.max_blocks_per_seq = max_blocks_per_seq
        pin = self.device.type == "cuda"
        self.offload = offload  # the host pool and its copies (KV tiers and swap), or None
        # Staging: fixed regions (see the module docstring), then the changed table entries.
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        max_seqs = max_num_seqs
        self._max_tokens, self._max_seqs = max_tokens, max_seqs
        o = self._offsets = {}
        cursor = 0
        for name, size in (("ids", max_tokens), ("pos", max_tokens), ("slots", num_groups * max_tokens),
                           ("rows", max_seqs),
                           ("lens", max_seqs), ("cu", max_seqs + 1), ("logits", max_seqs), ("fill_at", max_seqs),
                           ("fill_from", max_seqs)):
            o[name] = cursor
            cursor += size
        self._fixed = cursor
        max_updates = num_groups * (num_table_rows + 1) * max_blocks_per_seq
        self._host = [torch.zeros(cursor + 2 * max_updates, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._turn = 0
        self._dev = torch.zeros(cursor + 2 * max_updates, dtype=torch.int64, device=self.device)
        d = self._dev
        self.input_ids = d[o["ids"]:o["ids"] + max_tokens]
        self.positions = d[o["pos"]:o["pos"] + max_tokens]
        self.slot_mapping = d[o["slots"]:o["slots"] + max_tokens]
        # Layer groups 1.. (sliding-window models): each group's slots in its own fixed region.
        self.group_slot_mappings = [d[o["slots"] + g * max_tokens:o["slots"] + (g + 1) * max_tokens]
                                    for g in range(1, num_groups)]
        self.rows = d[o["rows"]:o["rows"] + max_seqs]
        self.seq_lens = d[o["lens"]:o["lens"] + max_seqs]
        self.cu_seqlens_q = d[o["cu"]:o["cu"] + max_seqs + 1]
        self.logits_indices = d[o["logits"]:o["logits"] + max_seqs]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_sizes: list[int] = []
        self.piecewise: PiecewiseGraphs | None = None
        # Steps with prefill tokens: attention captured too (the unified kernel), or run eagerly between pieces.
        self.capture_attention = mixed_step_graphs == "full"
        if is_own_model and self.device.type == "cuda" and not enforce_eager:
            self.capture_graphs(graph_batch_sizes(max_num_seqs))
            if mixed_step_graphs != "off":
                self.piecewise = self._piecewise(capture=True)
        elif not is_own_model and mixed_step_graphs != "off" and not enforce_eager and self.device.type == "cuda":
            logger.info("piecewise CUDA graphs: off for HF modules (mixed and prefill steps run eagerly)")

    def _piecewise(self, capture: bool) -> PiecewiseGraphs:
        """Piecewise graphs over this runner's staging views, one set per token bucket up to the step budget."""
        if capture:  # the captured passes read the staged inputs: padding tokens that store K/V to the scratch slot
            self._stage(StepInput(), padded_tokens=self._max_tokens, padded_seqs=self._max_seqs,
                        logit_rows=self._max_seqs, all_chunks=self.capture_attention)
            torch.cuda.synchronize(self.device)

        def prepare_replay():
            self.backend.prepare_for_mixed_replay(self.rows, self.seq_lens, self.cu_seqlens_q, self._max_seqs)

        return PiecewiseGraphs(self.model, self.backend, input_ids=self.input_ids, positions=self.positions,
                               slot_mapping=self.slot_mapping, logits_indices=self.logits_indices,
                               buckets=token_buckets(self._max_tokens), capture=capture,
                               capture_attention=self.capture_attention, prepare_replay=prepare_replay,
                               max_num_seqs=self._max_seqs, group_slot_mappings=self.group_slot_mappings)

    # ------------------------------------------------------------------ block movement
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks before one of their sharers writes."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        self.pool.copy_blocks(src, dst)

    # ------------------------------------------------------------------ staging
    def _stage(self, step: StepInput, padded_tokens: int = 0, padded_seqs: int = 0, logit_rows: int = 0,
               all_chunks: bool = False) -> int:
        """Pack `step` into the next pinned buffer and copy it to the device; returns the number of pending inputs.

        Padding for captured graphs: `padded_tokens` token rows (token 0, position 0, K/V to the
        scratch slot), `padded_seqs` sequence rows (the zero table, length 0, no query tokens) and
        `logit_rows` rows for the LM head (row 0, a real index). `all_chunks`: cu_seqlens_q covers
        every sequence, decode rows as one-token chunks (a captured mixed step's unified attention),
        instead of the prefill chunks alone.
        """
        host = self._host_np[self._turn]
        o = self._offsets
        n, s = step.num_tokens, step.num_seqs
        host[o["ids"]:o["ids"] + n] = step.input_ids
        host[o["pos"]:o["pos"] + n] = step.positions
        host[o["slots"]:o["slots"] + n] = step.slot_mapping
        host[o["rows"]:o["rows"] + s] = step.table_rows
        host[o["lens"]:o["lens"] + s] = step.seq_lens
        for g, slots in enumerate(step.group_slot_mapping, start=1):
            at = o["slots"] + g * self._max_tokens
            host[at:at + n] = slots
        if padded_tokens > n:
            host[o["ids"] + n:o["ids"] + padded_tokens] = 0
            host[o["pos"] + n:o["pos"] + padded_tokens] = 0
            for g in range(self.backend.num_groups):  # every layer group's padding rows write the scratch slot
                at = o["slots"] + g * self._max_tokens
                host[at + n:at + padded_tokens] = self.scratch_slot
        if padded_seqs > s:
            host[o["rows"] + s:o["rows"] + padded_seqs] = self.backend.padding_row
            host[o["lens"] + s:o["lens"] + padded_seqs] = 0
        if all_chunks:
            cu = o["cu"]
            host[cu] = 0
            np.cumsum(step.query_lens, out=host[cu + 1:cu + 1 + s])
            host[cu + 1 + s:cu + 1 + max(padded_seqs, s)] = n
        nd = step.num_decode_seqs
        if s > nd and not all_chunks:
            cu = o["cu"]
            host[cu] = 0
            np.cumsum(step.query_lens[nd:], out=host[cu + 1:cu + 1 + s - nd])
        num_sample = len(step.sample_seqs)
        if num_sample:
            # The flat index of each sampling row's last token.
            ends = np.cumsum(step.query_lens)
            host[o["logits"]:o["logits"] + num_sample] = ends[step.sample_seqs] - 1
        if logit_rows > num_sample:
            host[o["logits"] + num_sample:o["logits"] + logit_rows] = 0
        num_fill = len(step.pending_inputs)
        if num_fill:
            host[o["fill_at"]:o["fill_at"] + num_fill] = [at for at, _ in step.pending_inputs]
            host[o["fill_from"]:o["fill_from"] + num_fill] = [row for _, row in step.pending_inputs]
        num_updates = 0
        if step.table_updates:
            width = self.max_blocks_per_seq
            index, values = [], []
            for row, first, ids in step.table_updates:
                base = row * width + first
                index.extend(range(base, base + len(ids)))
                values.extend(ids)
            num_updates = len(index)
            start = self._fixed
            host[start:start + num_updates] = index
            host[start + num_updates:start + 2 * num_updates] = values
        end = self._fixed + 2 * num_updates
        self._dev[:end].copy_(self._host[self._turn][:end], non_blocking=True)
        self._turn ^= 1
        if num_updates:
            start = self._fixed
            self.backend.update_tables(self._dev[start:start + num_updates],
                                       self._dev[start + num_updates:start + 2 * num_updates])
        return num_fill

    def _fill_pending(self, num_fill: int, previous_tokens: torch.Tensor) -> None:
        """Input tokens sampled by the step still in flight: copied on the device, never through the host."""
        o = self._offsets
        at = self._dev[o["fill_at"]:o["fill_at"] + num_fill]
        rows = self._dev[o["fill_from"]:o["fill_from"] + num_fill]
        self.input_ids.index_copy_(0, at, previous_tokens.index_select(0, rows))

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    @no_collection_during_capture()
    def capture_graphs(self, sizes: list[int]) -> None:
        """Capture one decode graph per padded batch size (largest first, sharing one memory pool)."""
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        padding = StepInput()
        for bs in sorted(sizes, reverse=True):
            self._stage(padding, padded_tokens=bs, padded_seqs=bs)
            meta = self.backend.prepare_for_capture(bs, self.slot_mapping, self.group_slot_mappings)
            attn = self.backend.bind(meta)

            def run(bs=bs, attn=attn):
                self.backend.prepare_for_replay(self.rows, self.seq_lens, bs)
                return self.model(self.input_ids[:bs], self.positions[:bs], attn, None)

            run()  # compiles the kernels and settles cuBLAS workspaces outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
                logits = run()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.graph_sizes = sorted(self.graphs)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.0f MiB", len(sizes), max(sizes),
                    time.perf_counter() - start, (free_before - free_after) / 2**20)

    def release_graphs(self) -> None:
        """Drop the captured graphs (before a tensor-parallel group is destroyed).

        A graph that captured NCCL collectives keeps their communicator in use: destroying the
        process group while such a graph is alive blocks forever in the NCCL teardown (seen on
        two H200s with torch 2.11, even for one bare captured all-reduce: benchmarks/tools/tp_probe.py).
        """
        if self.graphs or self.piecewise is not None:
            torch.cuda.synchronize(self.device)
            self.graphs.clear()
            self.graph_sizes = []
            if self.piecewise is not None:
                self.piecewise.release()
                self.piecewise = None

    def _graph_for(self, num_seqs: int) -> int:
        for size in self.graph_sizes:
            if size >= num_seqs:
                return size
        return 0

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, step: StepInput, previous_tokens: torch.Tensor | None = None):
        """Run one step; returns the sampler's output (its `token_ids()` waits for the device) or None.

        `previous_tokens` [rows] are the device-side first samples of the step before, which
        `step.pending_inputs` refers to (async scheduling). Nothing here waits for the device; the
        step's disk reads (KV tiers), started first, are collected last, after the launch (see `KVOffload`).
        """
        if self.offload is None:
            return self._execute(step, previous_tokens)
        try:
            result = self._execute(step, previous_tokens)
        except BaseException:
            self.offload.finish_loads(failed=True)  # its reads still write into host blocks: wait for them
            raise
        self.offload.finish_loads(wait=not step.num_seqs)  # with nothing to compute, nothing to overlap them with
        return result

    def _execute(self, step: StepInput, previous_tokens: torch.Tensor | None):
        if self.offload is not None:
            self.offload.move(step)
        elif step.swap_out or step.swap_in or step.restore or step.restore_in_step or step.offload:
            raise RuntimeError("a step moves blocks to or from host memory, but the runner has no host pool")
        self.copy_blocks(step.block_copies)
        if not step.num_seqs:
            return None
        padded = self._graph_for(step.num_seqs) if step.is_decode_only and self.graphs else 0
        bucket = 0
        if not padded and self.piecewise is not None:
            bucket = self.piecewise.bucket_for(step.num_tokens)
        unified = bool(bucket) and self.piecewise.capture_attention
        num_fill = self._stage(step, padded_tokens=max(padded, bucket),
                               padded_seqs=self._max_seqs if unified else padded,
                               logit_rows=self.piecewise.logit_rows(bucket) if bucket else 0, all_chunks=unified)
        if num_fill:
            self._fill_pending(num_fill, previous_tokens)
        num_sample = len(step.sample_seqs)
        if padded:
            graph, graph_logits = self.graphs[padded]
            graph.replay()
            logits = graph_logits[:step.num_seqs]
            if num_sample != step.num_seqs:
                logits = logits.index_select(0, self.logits_indices[:num_sample])
        elif unified:  # the graph gathers its own metadata
            logits = self.piecewise.run(step.num_tokens, None)[:num_sample]
        else:
            nd = step.num_decode_seqs
            meta = self.backend.prepare(
                self.slot_mapping[:step.num_tokens], self.rows[:step.num_seqs], self.seq_lens[:step.num_seqs],
                self.cu_seqlens_q[:step.num_seqs - nd + 1], num_decode=nd, host_seq_lens=step.seq_lens,
                host_query_lens=step.query_lens, group_slot_mappings=self.group_slot_mappings)
            if bucket:
                logits = self.piecewise.run(step.num_tokens, meta)[:num_sample]
            else:
                indices = self.logits_indices[:num_sample] if num_sample else self.logits_indices[:1]
                logits = self.model(self.input_ids[:step.num_tokens], self.positions[:step.num_tokens],
                                    self.backend.bind(meta), indices)
        if not num_sample:
            return None
        return self._sample(logits, step, num_sample)

    def _sample(self, logits: torch.Tensor, step: StepInput, num_sample: int):
        """The sampler's output; under tensor parallelism only rank 0 samples.

        Rank 0 samples from the all-gathered logits and broadcasts each row's first token over
        the data group (an asynchronous device collective on CUDA); the other ranks receive them
        into `ReceivedTokens`, the next step's pending inputs. So the workers need no sampling
        rows (the bulk of a pickled step) and do no sampling work.
        """
        if self.tp is None:
            return self.sampler.sample(logits, step.sampling)
        if self.tp.rank == 0:
            result = self.sampler.sample(logits, step.sampling)
            result.device_tokens = result.device_tokens.contiguous()
            self.tp.broadcast_tensor(result.device_tokens)
            return result
        tokens = torch.empty(num_sample, dtype=torch.int64, device=self.device)
        self.tp.broadcast_tensor(tokens)
        return ReceivedTokens(tokens)
