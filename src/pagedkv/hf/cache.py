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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache

from pagedkv.core.allocator import BlockAllocator
from pagedkv.core.block_table import BlockTable
from pagedkv.errors import InvalidArgumentError, PagedKVError, require_positive_int
from pagedkv.hf.attention import ATTN_IMPLEMENTATION, STEP_ATTR, PagedAttentionMetadata, register
from pagedkv.kernels import KVPool


def kv_shape_of(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a HF text config, the way serving engines read it."""
    config = getattr(config, "text_config", None) or config
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    num_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    return int(num_layers), int(num_kv_heads), int(head_dim)


class PagedKVCacheBase(Cache):
    """What both paged caches share: `update` tags the key for the attention function and stores nothing.

    Subclasses provide `attention_metadata(attention_mask, batch, q_len)`, called by the
    attention function of every layer; it must return the same object for all layers of
    one forward.
    """

    def __init__(self, pool: KVPool):
        super().__init__(layers=[])
        self.pool = pool
        self._metadata: PagedAttentionMetadata | None = None
        self._attention_ran = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the new K/V back, tagged with this cache; the attention function writes them into pages."""
        if not self._attention_ran:
            raise PagedKVError(
                f"a pagedkv cache needs attn_implementation={ATTN_IMPLEMENTATION!r}, and the previous layer's "
                f"attention did not go through it. If the model uses another attn_implementation, call "
                f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) after `import pagedkv.hf`. If it already "
                f"asked for it, this architecture does not support custom attention functions (Falcon, for one, "
                f"runs its own attention code), so it cannot use a pagedkv cache"
            )
        if layer_idx == 0:
            self._metadata = None  # a new forward begins
        self._attention_ran = False
        setattr(key_states, STEP_ATTR, self)
        return key_states, value_states

    def attention_metadata(self, attention_mask: torch.Tensor | None, batch: int, q_len: int) -> PagedAttentionMetadata:
        """The metadata of the current forward (built on the first layer's call)."""
        self._attention_ran = True
        if self._metadata is None:
            self._metadata = self._build_metadata(attention_mask, batch, q_len)
        return self._metadata

    def _build_metadata(self, attention_mask, batch: int, q_len: int) -> PagedAttentionMetadata:
        raise NotImplementedError

    # transformers asks these of any cache
    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.pool.num_layers

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1


class PagePool:
    """K/V pages for one model, shared by any number of `PagedCache`s (one allocator, one tensor pool)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu"):
        require_positive_int("num_blocks", num_blocks)
        require_positive_int("block_size", block_size)
        self.kv = KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.allocator = BlockAllocator(num_blocks)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16) -> PagePool:
        """A pool shaped like `model`'s KV, on its device and in its dtype (registers the attention too)."""
        register()
        num_layers, num_kv_heads, head_dim = kv_shape_of(model.config)
        return cls(num_layers, num_kv_heads, head_dim, num_blocks, block_size, model.dtype, model.device)

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

    num_blocks: int
    paged_bytes: int  # blocks held x bytes per block
    naive_bytes: int  # batch x max_cache_len reserved up front
    dynamic_cache_bytes: int  # what DynamicCache holds for the same step, left padding included
    num_tokens: int  # real (non-pad) tokens stored
    utilization: float  # real tokens / slots in held blocks


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
        self._device_tables: torch.Tensor | None = None

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

    def reset(self) -> None:
        """Free every page and forget all tokens (the cache can be used again)."""
        self.free()

    def crop(self, max_length: int) -> None:
        """Drop the last tokens so `max_length` columns remain (negative: drop that many), as DynamicCache does."""
        if max_length < 0:
            max_length = self._seq_length + max_length
        remove = self._seq_length - max_length
        if remove <= 0 or self.tables is None:
            return
        for table in self.tables:
            table.truncate(max(0, table.num_tokens - remove))
        self._seq_length = max_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise PagedKVError("PagedCache does not support beam search reordering yet; use num_beams=1")

    # ------------------------------------------------------------------ paging
    def _build_metadata(self, attention_mask, batch: int, q_len: int) -> PagedAttentionMetadata:
        if self.tables is None:
            if self._max_batch_size is not None and batch > self._max_batch_size:
                raise InvalidArgumentError(
                    f"batch of {batch} sequences is larger than this cache's max_batch_size {self._max_batch_size}"
                )
            self.tables = [BlockTable(self.page_pool.allocator, self.pool.block_size, self._max_cache_len)
                           for _ in range(batch)]
        elif batch != len(self.tables):
            raise InvalidArgumentError(f"this cache holds {len(self.tables)} sequences; the forward has {batch}")
        device = self.pool.device

        token_index = None
        if q_len == 1 or attention_mask is None:
            num_new = [q_len] * batch
        else:
            new_mask = attention_mask[:, -q_len:].to(torch.bool)  # [batch, q_len]; pads are False
            num_new = new_mask.sum(dim=1).tolist()
            if sum(num_new) != batch * q_len:
                token_index = new_mask.reshape(-1).nonzero().squeeze(1)

        try:
            self._append(num_new)
        except PagedKVError:
            if self._seq_length == 0:
                self.tables = None  # a failed first forward leaves the cache as it was: unsized
            raise
        slots: list[int] = []
        for table, n in zip(self.tables, num_new):
            slots.extend(table.slot_mapping(table.num_tokens - n, table.num_tokens))
        self._seq_length += q_len

        seq_lens = [table.num_tokens for table in self.tables]
        max_blocks = max(1, max(table.num_blocks for table in self.tables))
        cu = [0]
        for n in num_new:
            cu.append(cu[-1] + n)
        # One host buffer, one host-to-device copy: [slots | seq_lens | cu_seqlens_q | block tables].
        packed = list(slots) + seq_lens + cu
        for table in self.tables:
            packed += table.block_ids
            packed += [0] * (max_blocks - table.num_blocks)
        on_device = torch.tensor(packed, dtype=torch.int64).to(device, non_blocking=True)
        n_slots = len(slots)
        slot_mapping = on_device[:n_slots]
        seq_lens_t = on_device[n_slots:n_slots + batch]
        cu_seqlens_q = on_device[n_slots + batch:n_slots + 2 * batch + 1]
        block_tables = on_device[n_slots + 2 * batch + 1:].view(batch, max_blocks)
        max_len = max(seq_lens)
        if q_len == 1:
            return PagedAttentionMetadata(slot_mapping, batch, block_tables, seq_lens_t, max_len,
                                          None, None, None, 0, 0, token_index)
        return PagedAttentionMetadata(slot_mapping, 0, None, None, 0, block_tables, seq_lens_t, cu_seqlens_q,
                                      max(num_new), max_len, token_index)

    def _append(self, num_new: list[int]) -> None:
        """Grow every row, all rows or none (a shortfall raises with nothing claimed)."""
        done = []
        try:
            for table, n in zip(self.tables, num_new):
                if table.append_tokens(n):
                    raise AssertionError("a PagedCache row never shares blocks, so never copies on write")
                done.append((table, n))
        except PagedKVError:
            for table, n in done:
                table.truncate(table.num_tokens - n)
            raise

    def free(self) -> None:
        """Give every block back to the pool; the cache is empty and reusable."""
        if self.tables is not None:
            for table in self.tables:
                table.free()
        self.tables = None
        self._seq_length = 0
        self._metadata = None
        self._attention_ran = True

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    # ------------------------------------------------------------------ accounting
    def memory(self) -> CacheMemory:
        """Blocks and bytes held now, against naive pre-allocation and DynamicCache."""
        tables = self.tables or []
        bytes_per_token = self.page_pool.bytes_per_token
        num_blocks = sum(t.num_blocks for t in tables)
        num_tokens = sum(t.num_tokens for t in tables)
        slots = num_blocks * self.pool.block_size
        naive_len = self._max_cache_len if self._max_cache_len is not None else self._seq_length
        return CacheMemory(
            num_blocks=num_blocks,
            paged_bytes=num_blocks * self.pool.bytes_per_block,
            naive_bytes=len(tables) * naive_len * bytes_per_token,
            dynamic_cache_bytes=len(tables) * self._seq_length * bytes_per_token,
            num_tokens=num_tokens,
            utilization=num_tokens / slots if slots else 0.0,
        )


__all__ = ["CacheMemory", "PagePool", "PagedCache", "PagedKVCacheBase", "kv_shape_of"]
