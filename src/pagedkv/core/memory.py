"""KV memory accounting: naive contiguous reservation against paged reservation.

Formulas (B = block size, in tokens):

    bytes/token            = 2 * layers * kv_heads * head_dim * dtype_bytes   (K and V)
    naive reserved tokens  = num_seqs * max_seq_len
    paged reserved tokens  = sum(ceil(len / B)) * B
    utilization            = sum(len) / reserved tokens
    internal fragmentation = sum(ceil(len / B) * B - len)   ~ (B - 1) / 2 tokens per sequence
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.block_table import num_blocks_for
from pagedkv.errors import ConfigError, InvalidArgumentError, require_positive_int

#: The `kv_cache_dtype` option of every entry point: "auto" stores K/V in the model's dtype, the
#: FP8 formats one byte per value (see `pagedkv.kernels.fp8`).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(kv_cache_dtype: object) -> str:
    """`kv_cache_dtype` if it is one of `KV_CACHE_DTYPES`; else `ConfigError` naming it and the allowed set."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; choose one of "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per stored K/V value: the model's for "auto", 1 for FP8; `ConfigError` naming an unknown option."""
    return model_dtype_bytes if check_kv_cache_dtype(kv_cache_dtype) == "auto" else 1


@dataclass(frozen=True)
class ModelSpec:
    """The KV-relevant shape of a model: what one token costs in every layer's K and V."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    name: str = "custom"

    def __post_init__(self):
        require_positive_int("num_layers", self.num_layers)
        require_positive_int("num_kv_heads", self.num_kv_heads)
        require_positive_int("head_dim", self.head_dim)
        require_positive_int("dtype_bytes", self.dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers, K and V."""
        return block_size * self.bytes_per_token


@dataclass(frozen=True)
class MemoryReport:
    """Naive vs paged reservation for one set of sequence lengths, in tokens and bytes."""

    num_seqs: int
    block_size: int
    max_seq_len: int
    stored_tokens: int
    naive_reserved_tokens: int
    paged_reserved_tokens: int
    num_blocks: int
    bytes_per_token: int

    @property
    def fragmentation_tokens(self) -> int:
        """Unused tail slots of every sequence's last block."""
        return self.paged_reserved_tokens - self.stored_tokens

    @property
    def fragmentation_per_seq(self) -> float:
        """Mean unused slots per sequence; about (B - 1) / 2 for lengths spread over many blocks."""
        return self.fragmentation_tokens / self.num_seqs if self.num_seqs else 0.0

    @property
    def naive_utilization(self) -> float:
        """Stored tokens / naive reserved tokens."""
        return self.stored_tokens / self.naive_reserved_tokens if self.naive_reserved_tokens else 0.0

    @property
    def paged_utilization(self) -> float:
        """Stored tokens / paged reserved tokens."""
        return self.stored_tokens / self.paged_reserved_tokens if self.paged_reserved_tokens else 0.0

    @property
    def naive_reserved_bytes(self) -> int:
        return self.naive_reserved_tokens * self.bytes_per_token

    @property
    def paged_reserved_bytes(self) -> int:
        return self.paged_reserved_tokens * self.bytes_per_token

    @property
    def fragmentation_bytes(self) -> int:
        return self.fragmentation_tokens * self.bytes_per_token

    @property
    def savings(self) -> float:
        """Naive reserved / paged reserved."""
        return self.naive_reserved_tokens / self.paged_reserved_tokens if self.paged_reserved_tokens else 0.0

    @property
    def table_entries_per_seq(self) -> int:
        """Block-table entries a max-length sequence needs: ceil(max_seq_len / B)."""
        return num_blocks_for(self.max_seq_len, self.block_size)


def memory_report(
    lengths: Sequence[int], block_size: int, max_seq_len: int, bytes_per_token: int = 1
) -> MemoryReport:
    """Account naive and paged reservation for sequences of the given lengths."""
    require_positive_int("block_size", block_size)
    require_positive_int("max_seq_len", max_seq_len)
    require_positive_int("bytes_per_token", bytes_per_token)
    for length in lengths:
        require_positive_int("sequence length", length, allow_zero=True)
        if length > max_seq_len:
            raise InvalidArgumentError(f"sequence length {length} is over max_seq_len {max_seq_len}")
    num_blocks = sum(num_blocks_for(length, block_size) for length in lengths)
    return MemoryReport(
        num_seqs=len(lengths),
        block_size=block_size,
        max_seq_len=max_seq_len,
        stored_tokens=sum(lengths),
        naive_reserved_tokens=len(lengths) * max_seq_len,
        paged_reserved_tokens=num_blocks * block_size,
        num_blocks=num_blocks,
        bytes_per_token=bytes_per_token,
    )
