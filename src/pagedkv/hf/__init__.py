"""Everything that imports transformers: the paged attention function, the drop-in cache, model loading.

Importing this package registers the `"pagedkv"` attention implementation with transformers.
"""

from pagedkv.hf.attention import ATTN_IMPLEMENTATION, PagedAttentionMetadata, paged_attention_forward, register
from pagedkv.hf.cache import CacheMemory, PagedCache, PagedKVCacheBase, PagePool, kv_shape_of
from pagedkv.hf.models import RANDOM_CONFIGS, load_model, load_tokenizer, random_model

register()

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
