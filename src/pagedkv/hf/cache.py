"""`PagedCache`: a drop-in paged KV cache for HuggingFace `model.generate` and `model(...)`.

    import pagedkv.hf
    model.set_attn_implementation("pagedkv")                 # the one added line
    pool = PagePool.for_model(model, num_blocks=4096)         # shared by every cache below
    with PagedCache(pool) as cache:
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

Each batch row owns a block table over the pool's allocator; a row claims a block only
when its last one is full, and pad tokens of a left-padded batch claim no slots at all
(they are never written, and the kernels never read them). New K/V are written into pages
in place: no `torch.cat`, no gathered copy. `free()` (or leaving the `with` block) gives
every block back, so the next batch reuses the same physical pages.

Rows share blocks instead of copying them. Every batch reshaping transformers asks of a
cache is a block-table fork (each shared block gains a reference):

    reorder_cache(beam_idx)        beam search: new row i continues old row beam_idx[i]
    batch_select_indices(idx)      keep / duplicate rows
    batch_repeat_interleave(n)     n samples of each prompt (parallel sampling)
    copy.deepcopy(cache)           prompt reuse: a second cache over the same blocks

so beams hold their common prefix once. A row about to write into a shared, partly filled
last block first moves onto a private copy of it (copy-on-write; the device copy is batched
into the step's metadata transfer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedkv.core.allocator import BlockAllocator
from pagedkv.core.block_table import BlockCopy, BlockTable
from pagedkv.env import env_choice
from pagedkv.errors import ConfigError, InvalidArgumentError, PagedKVError, require_positive_int
from pagedkv.hf.attention import ATTN_IMPLEMENTATION, PagedAttentionMetadata, register
from pagedkv.hf.cache_base import PagedKVCacheBase, host_int, row_indices
from pagedkv.hf.kv_scales import calibration_token_ids, checkpoint_kv_scales
from pagedkv.hf.step_metadata import StepMetadataPacker
from pagedkv.kernels import KVPool, resolve_backend
from pagedkv.kernels.fp8 import DEFAULT_HEADROOM, KVScales
from pagedkv.models.config import kv_shape_of

logger = logging.getLogger("pagedkv")


class PagePool:
    """K/V pages for one model, shared by any number of `PagedCache`s (one allocator, one tensor pool).

    `kv_cache_dtype="fp8_e4m3"` (or `"fp8_e5m2"`) stores one byte per value with the per-head
    `scales` (`pagedkv.kernels.fp8.KVScales`); `for_model` takes them from the checkpoint or
    calibrates them (`pagedkv.hf.kv_scales`).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu", *,
                 kv_cache_dtype: str = "auto", scales=None):
        require_positive_int("num_blocks", num_blocks)
        require_positive_int("block_size", block_size)
        self.kv = KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                         kv_cache_dtype=kv_cache_dtype, scales=scales)
        self.allocator = BlockAllocator(num_blocks)
        self._decode_write_kernel = None  # made on first use (it imports Triton)
        # Decode steps of this pool's caches through the fused K/V write + attention kernel (one
        # launch per layer, bound launches): on by default, PAGEDKV_FUSED_DECODE=0 or setting it to
        # False takes the write + decode pair. Its GPU tests check it against float64 on the device,
        # because the interpreter alone once passed a form that was wrong on the H200.
        self.fused_decode = env_choice("PAGEDKV_FUSED_DECODE", ("1", "0"), "1") == "1"

    def decode_write_kernel(self):
        """The fused decode + K/V write kernel bound to this pool's pages, shared by its caches (made once):
        its compiled launches outlive any one cache."""
        if self._decode_write_kernel is None:
            from pagedkv.kernels.triton_decode_write import DecodeWriteKernel

            self._decode_write_kernel = DecodeWriteKernel(self.kv)
        return self._decode_write_kernel

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, *, kv_cache_dtype: str = "auto",
                  scales=None, tokenizer=None) -> PagePool:
        """A pool shaped like `model`'s KV, on its device and in its dtype (registers the attention too).

        FP8 without `scales`: the checkpoint's, else calibrated on the built-in text (with
        `tokenizer`, or byte ids without one).
        """
        from pagedkv.kernels.fp8 import resolve_kv_cache_dtype

        register()
        num_layers, num_kv_heads, head_dim = kv_shape_of(model.config)
        storage = resolve_kv_cache_dtype(kv_cache_dtype, model.dtype, model.device)
        if scales is None and storage != model.dtype:
            scales = kv_scales_for(model, storage, tokenizer=tokenizer)
        return cls(num_layers, num_kv_heads, head_dim, num_blocks, block_size, model.dtype, model.device,
                   kv_cache_dtype=kv_cache_dtype, scales=scales)

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes of one token across all layers."""
        return self.kv.bytes_per_block // self.kv.block_size

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def usage(self) -> float:
        return self.allocator.usage

    def check_integrity(self) -> None:
        """Assert the allocator's bookkeeping is consistent."""
        self.allocator.check_integrity()


@dataclass(frozen=True)
class CacheMemory:
    """A cache's KV footprint at one step, against the alternatives, in bytes."""

    num_blocks: int  # distinct physical blocks its rows hold (a block shared by rows counts once)
    num_unshared_blocks: int  # blocks the rows would hold if none were shared (sum over rows)
    paged_bytes: int  # num_blocks x bytes per block
    naive_bytes: int  # batch x max_cache_len reserved up front
    dynamic_cache_bytes: int  # what DynamicCache holds for the same step: every row's copy, left padding included
    num_tokens: int  # real (non-pad) tokens stored, summed over rows
    utilization: float  # real tokens / slots of the rows' blocks, as if unshared

    @property
    def shared_fraction(self) -> float:
        """The fraction of the rows' blocks that sharing saves: 1 - num_blocks / num_unshared_blocks."""
        return 1.0 - self.num_blocks / self.num_unshared_blocks if self.num_unshared_blocks else 0.0


class PagedCache(PagedKVCacheBase):
    """A transformers `Cache` whose K/V live in a shared `PagePool`. See the module docstring."""

    def __init__(self, pool: PagePool, max_batch_size: int | None = None, max_cache_len: int | None = None):
        if not isinstance(pool, PagePool):
            raise InvalidArgumentError(f"PagedCache needs a PagePool, got {type(pool).__name__}")
        if max_batch_size is not None:
            require_positive_int("max_batch_size", max_batch_size)
        if max_cache_len is not None:
            require_positive_int("max_cache_len", max_cache_len)
        super().__init__(pool.kv)
        self.page_pool = pool
        self._max_batch_size = max_batch_size
        self._max_cache_len = max_cache_len
        self.tables: list[BlockTable] | None = None
        self._seq_length = 0  # columns seen, pads included (what generate calls the cache length)
        # True while every row's tokens are its last `num_tokens` columns (pads only on the left),
        # which is what lets `crop` drop columns per row without a per-column record.
        self._left_aligned = True
        self._packer = StepMetadataPacker(self.pool)
        # With `pool.fused_decode`, decode steps on the Triton backend run the fused decode + K/V write
        # kernel (one launch per layer). It stores the model's dtype: FP8 pools take write + decode.
        self._decode_kernel = pool.decode_write_kernel() if pool.fused_decode and not pool.kv.is_fp8 \
            and resolve_backend("auto", self.pool.device) == "triton" else None

    @property
    def max_batch_size(self) -> int | None:
        """The most sequences this cache accepts (None: any)."""
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int | None:
        """The most tokens one sequence may hold (None: as many as the pool has)."""
        return self._max_cache_len

    # ------------------------------------------------------------------ transformers Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_length

    @property
    def batch_size(self) -> int:
        return len(self.tables) if self.tables is not None else -1

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can roll back exactly: pages keep every token (sliding windows included),
        as long as pads were only ever on the left (see `crop`)."""
        return self._left_aligned

    def reset(self) -> None:
        """Free every page and forget all tokens (the cache can be used again)."""
        self.free()

    def crop(self, tokens_to_remove: int | torch.Tensor) -> None:
        """Remove tokens from the end, with transformers 5.17's meaning of the argument (as DynamicCache).

        `crop(-n)` removes n tokens (all of them if there are fewer), `crop(0)` does nothing, and
        a positive `crop(k)` is the legacy form: keep the first k tokens (nothing if k >= length).
        A 0-d integer tensor is accepted, as assisted and prompt-lookup decoding pass one.
        """
        tokens_to_remove = host_int("tokens_to_remove", tokens_to_remove)
        length = self._seq_length
        if tokens_to_remove > 0:  # legacy: the length to keep
            if tokens_to_remove >= length:
                return
            tokens_to_remove = length - tokens_to_remove
        else:
            tokens_to_remove = min(-tokens_to_remove, length)
        if tokens_to_remove == 0 or self.tables is None:
            return
        if not self._left_aligned:
            raise InvalidArgumentError(
                "crop needs every row's pads on its left; an attention mask with pads after real tokens was used, "
                "so the columns to drop are not known per row"
            )
        for table in self.tables:
            table.truncate(max(0, table.num_tokens - tokens_to_remove))
        self._seq_length = length - tokens_to_remove

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row i continues old row `beam_idx[i]`, by forking its block table (no K/V copied)."""
        if self._seq_length > 0:  # as DynamicCache: an empty cache has nothing to reorder
            self._select_rows(row_indices(beam_idx, len(self.tables)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (int indices may repeat: repeated rows share blocks; or a boolean mask)."""
        if self._seq_length > 0:
            self._select_rows(row_indices(indices, len(self.tables)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (row r becomes rows r*repeats ...), sharing its blocks."""
        repeats = require_positive_int("repeats", host_int("repeats", repeats))
        if self._seq_length > 0:
            self._select_rows([row for row in range(len(self.tables)) for _ in range(repeats)])

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """A second cache over the same pool whose rows fork this one's (copy-on-write; no K/V is copied)."""
        twin = PagedCache(self.page_pool, self._max_batch_size, self._max_cache_len)
        if self.tables is not None:
            twin.tables = [table.fork() for table in self.tables]
        twin._seq_length = self._seq_length
        twin._left_aligned = self._left_aligned
        memo[id(self)] = twin
        return twin

    # ------------------------------------------------------------------ paging
    def _select_rows(self, rows: list[int]) -> None:
        """New row i continues old row `rows[i]`: its first use takes the table over, later uses fork it."""
        old = self.tables
        taken = [False] * len(old)
        tables = []
        for row in rows:
            if taken[row]:
                tables.append(old[row].fork())
            else:
                taken[row] = True
                tables.append(old[row])
        for row, table in enumerate(old):
            if not taken[row]:
                table.free()
        self.tables = tables

    def _build_metadata(self, attention_mask, batch: int, q_len: int) -> PagedAttentionMetadata:
        if self.tables is None:
            if self._max_batch_size is not None and batch > self._max_batch_size:
                raise InvalidArgumentError(
                    f"batch of {batch} sequences is larger than this cache's max_batch_size {self._max_batch_size}"
                )
            self.tables = [BlockTable(self.page_pool.allocator, self.pool.block_size, self._max_cache_len)
                           for _ in range(batch)]
        elif batch != len(self.tables):
            raise InvalidArgumentError(
                f"this cache holds {len(self.tables)} sequences; the forward has {batch} (to sample or beam-search "
                f"from a filled cache, fork its rows first: cache.batch_repeat_interleave(n))"
            )

        num_new = None  # None: every row gains q_len tokens (decode steps, unpadded chunks)
        token_index = None
        if q_len > 1 and attention_mask is not None:
            new_mask = attention_mask[:, -q_len:].to(torch.bool)  # [batch, q_len]; pads are False
            # One host read for both: real tokens per row, and pads that follow a real token.
            pads_after_real = (new_mask[:, :-1] & ~new_mask[:, 1:]).sum(dim=1)
            counts, num_late_pads = torch.stack([new_mask.sum(dim=1), pads_after_real]).tolist()
            if sum(counts) != batch * q_len:
                num_new = counts
                token_index = new_mask.reshape(-1).nonzero().squeeze(1)
                if any(num_late_pads) or any(n < q_len and table.num_tokens
                                             for n, table in zip(counts, self.tables)):
                    self._left_aligned = False

        try:
            copies = self._append(num_new, q_len)
        except PagedKVError:
            if self._seq_length == 0:
                self.tables = None  # a failed first forward leaves the cache as it was: unsized
            raise
        self._seq_length += q_len
        if q_len == 1 and self._decode_kernel is not None:
            return self._packer.pack_decode(self.tables, copies, self._decode_kernel)
        return self._packer.pack(self.tables, num_new, q_len, copies, token_index)

    def _append(self, num_new: list[int] | None, q_len: int) -> list[BlockCopy]:
        """Grow every row, all rows or none (a shortfall raises with nothing claimed); returns the CoW copies."""
        copies: list[BlockCopy] = []
        tables = self.tables
        counts = [q_len] * len(tables) if num_new is None else num_new
        num_done = 0  # a counter, not a list of done rows: this loop runs once per row on every decode step
        try:
            for table, n in zip(tables, counts):
                row_copies = table.append_tokens(n)
                if row_copies:
                    copies += row_copies
                num_done += 1
        except PagedKVError:
            # A rolled-back row keeps its private copy of a shared block: fill it before anyone reads it.
            self._packer.copy_blocks(copies)
            for table, n in zip(tables[:num_done], counts):
                table.truncate(table.num_tokens - n)
            raise
        return copies


    def free(self) -> None:
        """Give every block back to the pool; the cache is empty and reusable."""
        if self.tables is not None:
            for table in self.tables:
                table.free()
        self.tables = None
        self._seq_length = 0
        self._left_aligned = True
        self._metadata = None
        self._attention_ran = True

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    # ------------------------------------------------------------------ accounting
    def memory(self) -> CacheMemory:
        """Blocks and bytes held now (shared blocks once), against naive pre-allocation and DynamicCache."""
        tables = self.tables or []
        bytes_per_token = self.page_pool.bytes_per_token
        num_blocks = len({block_id for table in tables for block_id in table.block_ids})
        num_unshared = sum(table.num_blocks for table in tables)
        num_tokens = sum(table.num_tokens for table in tables)
        slots = num_unshared * self.pool.block_size
        naive_len = self._max_cache_len if self._max_cache_len is not None else self._seq_length
        return CacheMemory(
            num_blocks=num_blocks,
            num_unshared_blocks=num_unshared,
            paged_bytes=num_blocks * self.pool.bytes_per_block,
            naive_bytes=len(tables) * naive_len * bytes_per_token,
            dynamic_cache_bytes=len(tables) * self._seq_length * bytes_per_token,
            num_tokens=num_tokens,
            utilization=num_tokens / slots if slots else 0.0,
        )


__all__ = ["CacheMemory", "PagePool", "PagedCache", "PagedKVCacheBase", "kv_shape_of"]


# ---------------------------------------------------------------------- FP8 scales by calibration
@torch.no_grad()
def calibrate_kv_scales(model: torch.nn.Module, token_ids: list[int], dtype: torch.dtype,
                        headroom: float = DEFAULT_HEADROOM, block_size: int = 16) -> KVScales:
    """Scales from one forward of `token_ids` through a model-dtype `PagedCache` (see `pagedkv.hf.kv_scales`)."""
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
    token_ids = list(token_ids)[:limit] if limit else list(token_ids)
    if not token_ids:
        raise ConfigError("calibration needs at least one token")
    num_layers, num_kv_heads, head_dim = kv_shape_of(model.config)
    pool = PagePool(num_layers, num_kv_heads, head_dim, -(-len(token_ids) // block_size), block_size, model.dtype,
                    model.device)
    previous = model.config._attn_implementation
    if previous != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with PagedCache(pool) as cache:
            ids = torch.tensor([token_ids], device=model.device)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            # The pool starts zeroed and holds only this pass's tokens: its amax is theirs.
            amax = pool.kv.kv.abs().amax(dim=(2, 3, 5)).float()  # [2, L, Hkv]
    finally:
        if previous != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(previous)
    return KVScales.from_amax(amax[0], amax[1], dtype, f"calibration: {len(token_ids)} tokens, headroom {headroom:g}",
                              headroom)


def kv_scales_for(model: torch.nn.Module, dtype: torch.dtype, *, tokenizer=None,
                  headroom: float = DEFAULT_HEADROOM) -> KVScales:
    """The checkpoint's scales if it has them, else calibrated ones; logs which."""
    name_or_path = getattr(model.config, "_name_or_path", None) or None
    scales = checkpoint_kv_scales(model, name_or_path)
    if scales is None:
        vocab = model.config.get_text_config().vocab_size
        scales = calibrate_kv_scales(model, calibration_token_ids(tokenizer, vocab), dtype, headroom)
    logger.info("FP8 KV scales from %s: K %.3g..%.3g, V %.3g..%.3g", scales.source, float(scales.k_scale.min()),
                float(scales.k_scale.max()), float(scales.v_scale.min()), float(scales.v_scale.max()))
    return scales
