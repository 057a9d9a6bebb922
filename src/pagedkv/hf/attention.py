"""One attention function for every HF model: K/V go into pages, attention reads them there.

transformers calls attention through `AttentionInterface`; pagedkv registers itself there
as `"pagedkv"`. Select it with the one line a user adds:

    model.set_attn_implementation("pagedkv")   # or from_pretrained(..., attn_implementation="pagedkv")

Both users of pagedkv's pages reach the model the same way, as a `past_key_values` cache
(a `PagedKVCacheBase`): the drop-in `PagedCache` for `model.generate`, and the engine's
per-step cache. In every layer the model calls `cache.update(key, value, layer_idx)`; the
paged cache only tags the key tensor with itself and hands it back, and the model passes
it straight to this attention function. Here, with the padding mask in view (a mask
function registered beside the attention function passes HF's 2-D mask through
untouched), the function:

1. asks the cache for the step's `PagedAttentionMetadata` (built once per forward);
2. writes the new tokens' K/V into their slots (`write_kv`'s unpadded scatter; pads were compacted away);
3. runs paged decode attention over the rows with one query token and paged prefill
   attention over the rest, reading K/V through the block tables, never gathering them.

A decode step of `PagedCache` on the Triton backend does 2 and 3 in one launch: the
metadata carries a `DecodeWriteStep` (the fused kernel with everything the layers share
fixed once per step), and the layer only hands it its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from pagedkv.errors import ModelMismatchError, PagedKVError
from pagedkv.kernels import paged_decode_attention, paged_prefill_attention, write_kv

ATTN_IMPLEMENTATION = "pagedkv"
STEP_ATTR = "_pagedkv_cache"  # attribute on the key tensor that carries the paged cache to this function


@dataclass
class PagedAttentionMetadata:
    """Where one forward's tokens go and what they attend to. Rows: decode tokens first, then prefill tokens.

    token layout (after compaction of pads):
        | decode tokens (1 per seq) | prefill tokens (ragged; cu_seqlens_q) |
        0                   num_decode_tokens                     num_tokens
    """

    slot_mapping: torch.Tensor | None  # [num_tokens] int64; negative = skip the write (None with decode_step)
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decode_seqs, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [num_decode_seqs] int32, kv length including the new token
    max_decode_seq_len: int
    prefill_block_tables: torch.Tensor | None  # [num_prefill_seqs, max_blocks] int32
    prefill_seq_lens: torch.Tensor | None  # [num_prefill_seqs] int32
    cu_seqlens_q: torch.Tensor | None  # [num_prefill_seqs + 1] int32, offsets into the prefill tokens
    max_seqlen_q: int
    max_prefill_seq_len: int
    # Rows of the model's flattened [batch * q_len] tokens that are real (None: all are).
    token_index: torch.Tensor | None = None
    # A decode step's fused K/V write + attention launcher (`kernels.triton_decode_write`); None: write, then attend.
    decode_step: object | None = None
    # Layer groups (sliding-window models in the engine): each layer's own metadata (its group's tables
    # and slots); None: this metadata serves every layer.
    layer_metadata: list[PagedAttentionMetadata] | None = None


def _model_sliding_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    return int(window) if window else None


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The `"pagedkv"` attention implementation (see the module docstring).

    query [batch, num_heads, q_len, head_dim]; key/value [batch, num_kv_heads, q_len, head_dim]
    (this forward's new tokens only). Returns ([batch, q_len, num_heads, head_dim], None).
    """
    if torch.is_grad_enabled():
        # Inference only: nothing differentiates through K/V written into pages. generate already
        # runs without grad, and a no_grad decorator would cost a context switch per layer.
        with torch.no_grad():
            return _paged_attention(module, query, key, value, attention_mask, scaling, kwargs)
    return _paged_attention(module, query, key, value, attention_mask, scaling, kwargs)


def _paged_attention(module, query, key, value, attention_mask, scaling, kwargs):
    cache = getattr(key, STEP_ATTR, None)
    if cache is None:
        raise PagedKVError(
            "attn_implementation 'pagedkv' needs a pagedkv cache as past_key_values (pagedkv.hf.PagedCache for "
            "model.generate, or the pagedkv engine); got none"
        )
    layer_idx = module.layer_idx
    pool = cache.pool
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if (num_kv_heads, head_dim) != (pool.num_kv_heads, pool.head_dim) or not 0 <= layer_idx < pool.num_layers:
        raise ModelMismatchError(
            f"this cache's pool was built for {pool.num_layers} layers x {pool.num_kv_heads} KV heads x head_dim "
            f"{pool.head_dim}, but layer {layer_idx} of the model has {num_kv_heads} KV heads x head_dim {head_dim}"
        )
    if key.dtype != pool.model_dtype or key.get_device() != cache.pool_device_index:
        raise ModelMismatchError(f"the model's K/V are {key.dtype} on {key.device} but the pool was made for "
                                 f"{pool.model_dtype} on {pool.device}")
    meta = cache.attention_metadata(attention_mask, batch, q_len)
    if meta.layer_metadata is not None:
        meta = meta.layer_metadata[layer_idx]
    step = meta.decode_step
    if step is not None:  # one launch: this layer's new K/V into their pages, and attention over them
        return step(layer_idx, query, key, value, scaling if scaling is not None else head_dim ** -0.5,
                    _model_sliding_window(module, kwargs), kwargs.get("softcap") or None), None

    num_rows = batch * q_len
    if q_len == 1:  # decode: dropping the length-1 axis is a view, where transpose + reshape costs more host time
        q, k, v = query.squeeze(2), key.squeeze(2), value.squeeze(2)  # [rows, H, D], [rows, Hkv, D]
    else:
        q = query.transpose(1, 2).reshape(num_rows, num_heads, head_dim)  # [rows, H, D]
        k = key.transpose(1, 2).reshape(num_rows, num_kv_heads, head_dim)  # [rows, Hkv, D]
        v = value.transpose(1, 2).reshape(num_rows, num_kv_heads, head_dim)
    if meta.token_index is not None:
        q, k, v = q.index_select(0, meta.token_index), k.index_select(0, meta.token_index), \
            v.index_select(0, meta.token_index)

    k_cache, v_cache = pool.k_caches[layer_idx], pool.v_caches[layer_idx]
    k_scale, v_scale = pool.kv_scales(layer_idx)
    # Pads were compacted away above, so every slot is real: write_kv's unpadded scatter, into slot-row
    # views the cache made once (a view per call costs as much host time as the copy's launch).
    if k_scale is None:
        cache.k_rows[layer_idx].index_copy_(0, meta.slot_mapping, k)
        cache.v_rows[layer_idx].index_copy_(0, meta.slot_mapping, v)
    else:  # FP8: quantized inside the write
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, validate=False, has_padding=False, k_scale=k_scale,
                 v_scale=v_scale)

    scale = scaling if scaling is not None else head_dim ** -0.5
    window = _model_sliding_window(module, kwargs)
    soft_cap = kwargs.get("softcap") or None
    nd = meta.num_decode_tokens
    if nd and nd == num_rows:  # a decode step: one launch over every row, nothing sliced or scattered back
        out = paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                     scale=scale, max_seq_len=meta.max_decode_seq_len, sliding_window=window,
                                     soft_cap=soft_cap, validate=False, k_scale=k_scale, v_scale=v_scale)
        return out.view(batch, q_len, num_heads, head_dim), None
    out = torch.empty_like(q)
    if nd:
        paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                               scale=scale, max_seq_len=meta.max_decode_seq_len, sliding_window=window,
                               soft_cap=soft_cap, out=out[:nd], validate=False, k_scale=k_scale, v_scale=v_scale)
    paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
                            meta.cu_seqlens_q, scale=scale, max_seqlen_q=meta.max_seqlen_q,
                            max_seq_len=meta.max_prefill_seq_len, sliding_window=window, soft_cap=soft_cap,
                            out=out[nd:], validate=False, k_scale=k_scale, v_scale=v_scale)
    if meta.token_index is not None:
        full = out.new_zeros(num_rows, num_heads, head_dim)
        full.index_copy_(0, meta.token_index, out)
        out = full
    return out.view(batch, q_len, num_heads, head_dim), None


def _passthrough_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """HF's 2-D padding mask, untouched: the paged kernels are causal by construction and need only the pads."""
    return attention_mask


def register() -> str:
    """Register `"pagedkv"` with transformers' attention and mask interfaces (idempotent); returns the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _passthrough_mask)
    return ATTN_IMPLEMENTATION
