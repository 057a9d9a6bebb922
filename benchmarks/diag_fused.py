"""Why does PagedCache's fused decode path fail the fp32 generate-equality tests on the H200? (GPU only)

Runs the failing test's setup (tiny random models, fp32, a left-padded batch of 8, 24 greedy
tokens) through variants that each remove one GPU-only difference:

    unfused        write_kv + paged decode (the default path: passes)
    fused          the bound fused launch (fails at 353542d)
    fused-triton   the fused kernel through Triton's own launcher (no bound launch)
    fused-sync     the bound launch with a device sync after every layer (no async overlap)

For each: whether the tokens equal DynamicCache + sdpa's, the first differing column, and the
largest logit difference against the oracle per step (a numerical near-tie gives ~1e-6, a bug
gives ~1e-1). Then the kernel alone: fused vs the float64 reference, unfused decode vs the
same, at the test's shapes, repeated to catch nondeterminism. Prints one JSON line per result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from pagedkv.hf import PagedCache, PagePool, random_model
from pagedkv.kernels import triton_decode_write as tdw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import helpers  # noqa: E402 - the tests' own batch builder, so the diagnosis runs the failing test's inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: TRITON_INTERPRET=1 PAGEDKV_KERNEL_BACKEND=triton


def left_padded(lengths):
    """The GPU tests' left-padded batch (`tests/helpers.py`), on DEVICE."""
    ids, mask = helpers.left_padded(lengths)
    return ids.to(DEVICE), mask.to(DEVICE)


def run(model, ids, mask, cache):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, past_key_values=cache,
                         pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)  # [steps, batch, vocab]


def variant(model, ids, mask, name):
    pool = PagePool.for_model(model, num_blocks=256, block_size=16)
    pool.fused_decode = name != "unfused"
    if name == "fused-triton":
        pool._decode_write_kernel = tdw.DecodeWriteKernel(pool.kv, bindable=False)
    original = tdw.DecodeWriteStep.__call__
    if name == "fused-sync":
        def synced(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            torch.cuda.synchronize() if DEVICE == "cuda" else None
            return out
        tdw.DecodeWriteStep.__call__ = synced
    try:
        with PagedCache(pool) as cache:
            return run(model, ids, mask, cache)
    finally:
        tdw.DecodeWriteStep.__call__ = original


def generate_checks():
    for family in ["tiny-llama", "tiny-gpt2", "tiny-qwen3"]:
        model = random_model(family, torch.float32, DEVICE)
        ids, mask = left_padded([5, 9, 13, 2, 17, 1, 8, 11])
        model.set_attn_implementation("sdpa")
        oracle_seq, oracle_logits = run(model, ids, mask, DynamicCache())
        model.set_attn_implementation("pagedkv")
        for name in ["unfused", "fused", "fused-triton", "fused-sync"]:
            seq, logits = variant(model, ids, mask, name)
            differ = (seq != oracle_seq).any(0).nonzero().flatten().tolist()
            steps = min(len(logits), len(oracle_logits))
            per_step = (logits[:steps] - oracle_logits[:steps]).abs().amax(dim=(1, 2)).tolist()
            print(json.dumps({"check": "generate", "family": family, "variant": name,
                              "equal": bool(torch.equal(seq, oracle_seq)), "first_diff_col": differ[:1],
                              "max_logit_diff_first_steps": [f"{d:.2e}" for d in per_step[:6]],
                              "max_logit_diff": f"{max(per_step):.2e}"}), flush=True)


def kernel_checks():
    from pagedkv.kernels import paged_decode_attention, paged_decode_write_attention
    from pagedkv.kernels.tuning import DecodeTuning

    torch.manual_seed(0)
    for heads, kv_heads, dim, lens in [(6, 2, 16, [5, 9, 13, 2, 17, 1, 8, 11]), (4, 4, 16, [30, 41, 7]),
                                       (32, 8, 128, [100, 700, 33])]:
        block = 16
        batch = len(lens)
        width = 8 * ((max(lens) + block - 1) // block)
        num_blocks = batch * width + 1
        k_cache = torch.randn(num_blocks, block, kv_heads, dim, device=DEVICE)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(num_blocks - 1, device=DEVICE)[:batch * width] + 1
        tables = perm.view(batch, width).to(torch.int32)
        seq_lens = torch.tensor(lens, device=DEVICE, dtype=torch.int32)
        q = torch.randn(batch, heads, dim, device=DEVICE)
        k_new = torch.randn(batch, kv_heads, dim, device=DEVICE)
        v_new = torch.randn_like(k_new)
        ref = tdw.reference_decode_write_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), tables,
                                                   seq_lens, scale=dim ** -0.5, float64=True)
        worst_fused = worst_unfused = 0.0
        distinct = set()
        for _ in range(20):
            kc, vc = k_cache.clone(), v_cache.clone()
            out = torch.empty_like(q)
            paged_decode_write_attention(q, k_new, v_new, kc, vc, tables, seq_lens, scale=dim ** -0.5,
                                         max_seq_len=max(lens), num_splits=1, out=out, backend="triton", validate=False)
            worst_fused = max(worst_fused, (out.double() - ref).abs().max().item())
            distinct.add(hash(out.cpu().numpy().tobytes()))
            kc2, vc2 = k_cache.clone(), v_cache.clone()
            tdw.reference_write_kv(k_new, v_new, kc2, vc2, torch.tensor(
                [int(tables[b, (n - 1) // block]) * block + (n - 1) % block for b, n in enumerate(lens)]))
            written_ok = torch.equal(kc, kc2) and torch.equal(vc, vc2)
            unfused = paged_decode_attention(q, kc2, vc2, tables, seq_lens, scale=dim ** -0.5,
                                             max_seq_len=max(lens), backend="triton", validate=False)
            worst_unfused = max(worst_unfused, (unfused.double() - ref).abs().max().item())
        print(json.dumps({"check": "kernel", "shape": [heads, kv_heads, dim], "lens": lens,
                          "fused_max_err": f"{worst_fused:.2e}", "unfused_max_err": f"{worst_unfused:.2e}",
                          "distinct_fused_outputs": len(distinct), "cache_written_equal": written_ok}), flush=True)


if __name__ == "__main__":
    which = sys.argv[1:] or ["kernel", "generate"]
    if "kernel" in which:
        kernel_checks()
    if "generate" in which:
        generate_checks()
