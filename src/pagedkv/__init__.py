"""pagedkv: a paged KV cache for LLM inference.

KV memory is a pool of fixed-size blocks; each sequence owns a list of block ids (its block
table) and claims blocks on demand, instead of reserving max_seq_len up front.

The paging core (`BlockAllocator`, `BlockTable`, accounting) is pure Python and imported
eagerly. The torch-based parts (`LLM`, `SamplingParams`, `PagedCache`, ...) load on first
use, so `import pagedkv` stays cheap.
"""

from __future__ import annotations

import importlib

from pagedkv.core import (
    DEFAULT_MIX,
    BlockAllocator,
    BlockCopy,
    BlockTable,
    LengthBucket,
    MemoryReport,
    ModelSpec,
    generate_lengths,
    memory_report,
    num_blocks_for,
)
from pagedkv.errors import (
    ConfigError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    KernelInputError,
    ModelMismatchError,
    OutOfBlocksError,
    PagedKVError,
    RequestRejectedError,
    SamplingParamsError,
    SequenceTooLongError,
)

__version__ = "0.1.0"

# name -> module that defines it; loaded lazily because these import torch / transformers.
_LAZY = {
    "LLM": "pagedkv.engine.llm",
    "SamplingParams": "pagedkv.engine.sampling_params",
    "EngineConfig": "pagedkv.engine.config",
    "LLMEngine": "pagedkv.engine.engine",
    "PagedCache": "pagedkv.hf.cache",
    "PagePool": "pagedkv.hf.cache",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT_MIX",
    "BlockAllocator",
    "BlockCopy",
    "BlockTable",
    "ConfigError",
    "DoubleFreeError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "KernelInputError",
    "LengthBucket",
    "MemoryReport",
    "ModelMismatchError",
    "ModelSpec",
    "OutOfBlocksError",
    "PagedKVError",
    "RequestRejectedError",
    "SamplingParamsError",
    "SequenceTooLongError",
    "generate_lengths",
    "memory_report",
    "num_blocks_for",
    *_LAZY,
]
