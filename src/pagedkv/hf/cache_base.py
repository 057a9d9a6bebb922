"""`PagedKVCacheBase`: the transformers `Cache` contract every paged cache shares.

transformers calls `update(key, value, layer_idx)` on its cache in every attention layer and
expects the full K/V back; a paged cache stores nothing there. `update` only tags the key with
the cache, and the `"pagedkv"` attention function (`pagedkv.hf.attention`) asks the tagged cache
for the forward's `PagedAttentionMetadata` and writes the new K/V into pages itself. The same
metadata object serves every layer of one forward. `host_int` and `row_indices` read the
arguments transformers passes to a cache's batch methods (ints or device tensors, index or
boolean-mask rows).

Two subclasses: `pagedkv.hf.cache.PagedCache` (block tables of its own, for `model.generate`)
and the engine runner's step cache, which hands out metadata the runner prepared.
"""

from __future__ import annotations

import operator

import torch
from transformers import Cache

from pagedkv.errors import InvalidArgumentError, PagedKVError
from pagedkv.hf.attention import ATTN_IMPLEMENTATION, STEP_ATTR, PagedAttentionMetadata
from pagedkv.kernels import KVPool


class PagedKVCacheBase(Cache):
    """What both paged caches share: `update` tags the key for the attention function and stores nothing.

    Subclasses provide `attention_metadata(attention_mask, batch, q_len)`, called by the
    attention function of every layer; it must return the same object for all layers of
    one forward.
    """

    def __init__(self, pool: KVPool):
        super().__init__(layers=[])
        self.pool = pool
        # Per layer, the K and V pages as [num_blocks * block_size, Hkv, D]: a slot is a row index.
        # Made once here, so the attention function's write is one index_copy_ each, with no view per call.
        self.k_rows = [k.view(-1, pool.num_kv_heads, pool.head_dim) for k in pool.k_caches]
        self.v_rows = [v.view(-1, pool.num_kv_heads, pool.head_dim) for v in pool.v_caches]
        self.pool_device_index = pool.kv.get_device()  # what `Tensor.get_device()` of the model's K/V must equal
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

    def __len__(self) -> int:
        """The number of layers, as transformers reads `len(cache)`."""
        return self.pool.num_layers

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


def host_int(name: str, value: object) -> int:
    """An int from an int or a one-element integer tensor (one host read: generate passes device tensors)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def row_indices(indices: object, num_rows: int) -> list[int]:
    """Row numbers in [0, num_rows) from an int or bool tensor (or a sequence), read as tensor indexing would."""
    indices = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
    if indices.dim() != 1 or indices.is_floating_point() or indices.is_complex():
        raise InvalidArgumentError(f"row indices must be a 1-D integer or boolean tensor, got {tuple(indices.shape)} "
                                   f"{indices.dtype}")
    if indices.dtype == torch.bool:
        if indices.numel() != num_rows:
            raise InvalidArgumentError(f"a boolean row mask must have {num_rows} entries (one per row), "
                                       f"got {indices.numel()} entries")
        return indices.nonzero().squeeze(1).tolist()
    rows = indices.tolist()
    for i, row in enumerate(rows):
        if not -num_rows <= row < num_rows:
            raise InvalidArgumentError(f"row index {row} is outside the cache's {num_rows} rows")
        if row < 0:
            rows[i] = row + num_rows
    return rows


__all__ = ["PagedKVCacheBase", "host_int", "row_indices"]
