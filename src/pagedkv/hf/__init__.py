"""The HF glue: the paged attention function HF models call, and the drop-in cache for `model.generate`.

Importing this package registers the `"pagedkv"` attention implementation with transformers.
The model loader lives in `pagedkv.models.loader`; its functions are offered here too, loaded
on first use (the loader itself imports this package's attention function).
"""

import importlib

from pagedkv.hf.attention import ATTN_IMPLEMENTATION, PagedAttentionMetadata, paged_attention_forward, register
from pagedkv.hf.cache import CacheMemory, PagedCache, PagedKVCacheBase, PagePool, kv_shape_of

register()

_FROM_LOADER = ("RANDOM_CONFIGS", "load_model", "load_tokenizer", "random_model")


def __getattr__(name: str):
    if name in _FROM_LOADER:
        return getattr(importlib.import_module("pagedkv.models.loader"), name)
    raise AttributeError(f"module 'pagedkv.hf' has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATION",
    "RANDOM_CONFIGS",
    "CacheMemory",
    "PagePool",
    "PagedAttentionMetadata",
    "PagedCache",
    "PagedKVCacheBase",
    "kv_shape_of",
    "load_model",
    "load_tokenizer",
    "paged_attention_forward",
    "random_model",
    "register",
]
