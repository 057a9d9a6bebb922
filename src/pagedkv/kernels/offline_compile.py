"""Compile the Triton kernels for a GPU on a machine without one: compile errors and resource use, before the GPU run.

The interpreter (TRITON_INTERPRET=1) checks what a kernel computes but never compiles it,
so a kernel can pass every CPU test and still fail on the GPU: a persistent decode loop once did,
crashing Triton 3.6's software pipeliner. Triton compiles through ptxas without a device,
so this module swaps in a stand-in driver that names an sm_90 target, runs each launcher
with CPU tensors (launches become compile-only `warmup`s), and reads every cubin's resource
use with the bundled `cuobjdump`:

    case, kernel, shared bytes, registers, stack bytes, async copies (cp.async pipelining),
    wgmma ops, and residency: programs per SM that fit (registers, shared memory, warps)

`python -m pagedkv.kernels.offline_compile` prints the table (TRITON_INTERPRET must be unset).
The stand-in driver leans on Triton internals (`driver.set_active`, `JITFunction.run`), so a
Triton upgrade may need this file touched; the kernels themselves do not depend on it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

#: sm_90 (H100 / H200) per-SM limits used for residency.
REGISTERS_PER_SM, SHARED_BYTES_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 233472, 64, 32
#: Shared memory the driver reserves per program, and the register allocation unit per warp.
RESERVED_SHARED_BYTES, REGISTER_UNIT = 1024, 256


def residency(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Programs of this size that fit on one sm_90 SM at once."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    return min(REGISTERS_PER_SM // (per_warp * num_warps),
               SHARED_BYTES_PER_SM // (shared_bytes + RESERVED_SHARED_BYTES), MAX_WARPS_PER_SM // num_warps,
               MAX_PROGRAMS_PER_SM)


@contextlib.contextmanager
def compile_only(capability: int = 90):
    """Inside: Triton targets sm_`capability` with no device, and every launch compiles without running.

    Yields the list that collects (kernel name, CompiledKernel, num_warps) per launch.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("offline compilation needs TRITON_INTERPRET unset (the interpreter never compiles)")
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime import jit

    class StandInDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    launched: list = []
    original_run = jit.JITFunction.run

    def compile_run(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append((self.fn.__name__, kernel, kwargs.get("num_warps", 4)))
        return kernel

    previous = driver._active
    driver.set_active(StandInDriver())
    jit.JITFunction.run = compile_run
    try:
        yield launched
    finally:
        jit.JITFunction.run = original_run
        driver._active = previous


def resource_usage(kernel) -> dict:
    """Registers and stack bytes of a compiled kernel, from `cuobjdump --dump-resource-usage` of its cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(item.split(":", 1) for line in text.splitlines() if "REG:" in line for item in line.split())
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"])}


def _cases():
    """(case name, launcher call, facts for the tests): the kernels at the engine's and the benchmark's shapes."""
    import torch

    from pagedkv.kernels import (
        DecodeTuning,
        UnifiedTuning,
        paged_attention,
        paged_decode_attention,
        paged_decode_write_attention,
        paged_prefill_attention,
        write_kv,
    )

    def paged(batch, seq_len, heads, page=16, dtype=torch.bfloat16):
        num_heads, num_kv_heads, head_dim = heads
        num_blocks = batch * -(-seq_len // page)
        k_cache = torch.zeros(num_blocks, page, num_kv_heads, head_dim, dtype=dtype)
        table = torch.arange(num_blocks, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), seq_len, dtype=torch.int32)
        return torch.zeros(batch, num_heads, head_dim, dtype=dtype), k_cache, k_cache.clone(), table, lens

    def decode(heads, tuning, **options):
        query, k_cache, v_cache, table, lens = paged(8, 4096, heads)
        return lambda: paged_decode_attention(query, k_cache, v_cache, table, lens, scale=0.1, max_seq_len=4096,
                                              num_splits=4, validate=False, backend="triton", tuning=tuning,
                                              **options)

    def varlen(call, heads, tuning, **options):
        _, k_cache, v_cache, table, lens = paged(2, 2048, heads)
        query = torch.zeros(4096, heads[0], heads[2], dtype=torch.bfloat16)
        cu = torch.tensor([0, 2048, 4096], dtype=torch.int32)
        return lambda: call(query, k_cache, v_cache, table, lens, cu, scale=0.1, max_seqlen_q=2048, validate=False,
                            backend="triton", tuning=tuning, **options)

    def short_on_long(heads, tuning):
        """80 new tokens on a 16K-token cached prefix (a warm chat turn) and a decode row: the split-KV variant."""
        _, k_cache, v_cache, table, lens = paged(2, 16464, heads)
        query = torch.zeros(81, heads[0], heads[2], dtype=torch.bfloat16)
        cu = torch.tensor([0, 80, 81], dtype=torch.int32)
        return lambda: paged_attention(query, k_cache, v_cache, table, lens, cu, scale=0.1, max_seqlen_q=80,
                                       validate=False, backend="triton", tuning=tuning)

    def decode_write(heads, num_splits, dtype=torch.bfloat16):
        query, k_cache, v_cache, table, lens = paged(8, 4096, heads, dtype=dtype)
        key = torch.zeros(8, heads[1], heads[2], dtype=dtype)
        return lambda: paged_decode_write_attention(query, key, key.clone(), k_cache, v_cache, table, lens, scale=0.1,
                                                    max_seq_len=4096, num_splits=num_splits, validate=False,
                                                    backend="triton")

    def split_prefill(**tuning):
        """Two 512-token chunks on 512-token prefixes at page 16 (the prefix gathered by rows)."""
        from pagedkv.kernels.triton_prefill_split import triton_split_prefill_attention
        from pagedkv.kernels.tuning import SplitPrefillTuning

        _, k_cache, v_cache, table, lens = paged(2, 1024, (32, 8, 128))
        qkv = torch.zeros(1024, 48 * 128, dtype=torch.bfloat16)
        query, key, value = (qkv[:, :4096].view(1024, 32, 128), qkv[:, 4096:5120].view(1024, 8, 128),
                             qkv[:, 5120:].view(1024, 8, 128))
        cu = torch.tensor([0, 512, 1024], dtype=torch.int32)
        return lambda: triton_split_prefill_attention(query, key, value, k_cache, v_cache, table, lens, cu,
                                                      torch.empty_like(query), scale=0.1, max_seqlen_q=512,
                                                      max_seq_len=1024, tuning=SplitPrefillTuning(**tuning))

    def gluon_prefill(heads, block_size, dtype=torch.bfloat16):
        """The Hopper prefill (Gluon): a 512-token chunk on a ragged 1,000-token prefix, and a fresh 512 prompt."""
        from pagedkv.kernels.gluon_prefill import gluon_prefill_attention

        num_heads, num_kv_heads, head_dim = heads
        _, k_cache, v_cache, table, _ = paged(2, 1536, heads, page=block_size, dtype=dtype)
        lens = torch.tensor([1512, 512], dtype=torch.int32)
        qkv = torch.zeros(1024, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        query, key, value = (qkv[:, :q_end].view(1024, num_heads, head_dim),
                             qkv[:, q_end:k_end].view(1024, num_kv_heads, head_dim),
                             qkv[:, k_end:].view(1024, num_kv_heads, head_dim))
        cu = torch.tensor([0, 512, 1024], dtype=torch.int32)
        return lambda: gluon_prefill_attention(query, key, value, k_cache, v_cache, table, lens, cu,
                                               torch.empty_like(query), scale=0.1, max_seqlen_q=512)

    def write():
        key = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
        k_cache = torch.zeros(10, 16, 8, 128, dtype=torch.bfloat16)
        return lambda: write_kv(key, key, k_cache, k_cache.clone(), torch.arange(4), validate=False, backend="triton")

    def gemma_layer_ops():
        from pagedkv.kernels import layer_ops

        hidden = torch.zeros(8, 1152, dtype=torch.bfloat16)
        norm = torch.zeros(1152, dtype=torch.bfloat16)
        qkv = torch.zeros(8, 6 * 256, dtype=torch.bfloat16)
        table = torch.zeros(64, 256)
        k_cache = torch.zeros(4, 16, 1, 256, dtype=torch.bfloat16)
        head_norm = torch.zeros(256, dtype=torch.bfloat16)
        slots = torch.zeros(8, dtype=torch.int64)

        def call():
            layer_ops.add_rms_norm(hidden, hidden.clone(), norm, 1e-6, offset=True)
            layer_ops.qk_norm_rope_write_kv(qkv, slots, table, table, head_norm, head_norm, 1e-6, k_cache,
                                            k_cache.clone(), slots, num_heads=4, num_kv_heads=1, head_dim=256,
                                            offset=True)
            layer_ops.silu_mul(torch.zeros(8, 2 * 6912, dtype=torch.bfloat16), gelu_tanh=True)
        return call

    llama, masked = (32, 8, 128), {"sliding_window": 100, "soft_cap": 30.0}
    wide = dict(block_m=128, block_n=64, num_warps=8, num_stages=2, maxnreg=128, num_splits=2)
    return [
        ("decode split llama3", decode(llama, DecodeTuning()), {"head_dim": 128, "masked": False}),
        ("decode in-kernel merge llama3", decode(llama, DecodeTuning(merge="in_kernel")),
         {"head_dim": 128, "masked": False}),
        ("decode split llama3 window+cap", decode(llama, DecodeTuning(), **masked), {"head_dim": 128, "masked": True}),
        ("decode split d256", decode((8, 2, 256), DecodeTuning()), {"head_dim": 256, "masked": False}),
        ("decode+write gpt2 fp16", decode_write((12, 12, 64), 1, torch.float16), {"head_dim": 64, "masked": False}),
        ("decode+write split llama3", decode_write(llama, 4), {"head_dim": 128, "masked": False}),
        ("prefill llama3", varlen(paged_prefill_attention, llama, None), {}),
        ("unified m64 llama3", varlen(paged_attention, llama, UnifiedTuning()), {}),
        ("unified m16 llama3", varlen(paged_attention, llama, UnifiedTuning(block_m=16)), {}),
        ("unified smollm2 window+cap", varlen(paged_attention, (9, 3, 64), None, **masked), {}),
        ("unified d80 group 7", varlen(paged_attention, (14, 2, 80), UnifiedTuning()), {}),
        ("unified split-kv qwen3", short_on_long((16, 8, 128), UnifiedTuning(num_splits=8)), {}),
        ("unified split-kv d256", short_on_long((8, 2, 256), UnifiedTuning(num_splits=4)), {}),
        ("split prefill wide llama3", split_prefill(**wide), {}),
        ("split prefill wide gqa-packed llama3", split_prefill(**wide, pack_gqa=True), {}),
        ("gluon prefill llama3 page 16", gluon_prefill(llama, 16), {}),
        ("gluon prefill llama3 page 128", gluon_prefill(llama, 128), {}),
        ("gluon prefill smollm2 fp16 page 64", gluon_prefill((9, 3, 64), 64, torch.float16), {}),
        ("write_kv llama3", write(), {}),
        ("decode tiles gemma3 window+cap", decode((4, 1, 256), DecodeTuning(schedule="tiles"), sliding_window=512,
                                                  soft_cap=30.0), {"head_dim": 256, "masked": True}),
        ("gemma3 layer ops offset+gelu", gemma_layer_ops(), {}),
    ]


def compile_all(capability: int = 90) -> list[dict]:
    """One row per kernel each case launches; a case that fails to compile gets an `error` row instead."""
    rows = []
    with compile_only(capability) as launched:
        for case, call, facts in _cases():
            launched.clear()
            try:
                call()
            except Exception as error:  # noqa: BLE001 - reported per case; the caller decides
                rows.append({"case": case, "kernel": None, "error": f"{type(error).__name__}: {error}"[:500], **facts})
                continue
            for name, kernel, num_warps in launched:
                usage = resource_usage(kernel)
                ttgir = kernel.asm["ttgir"]
                rows.append({"case": case, "kernel": name, "error": "", "num_warps": num_warps, **facts,
                             "shared_bytes": kernel.metadata.shared, **usage,
                             "async_copies": ttgir.count("async_copy_global_to_local"),
                             "wgmma": ttgir.count("warp_group_dot"),
                             "residency": residency(usage["registers"], kernel.metadata.shared, num_warps)})
    return rows


def main() -> int:
    """Print the table; exit 1 when any case failed to compile."""
    import json

    rows = compile_all()
    if "--json" in sys.argv:
        print(json.dumps(rows))
    else:
        for row in rows:
            if row["error"]:
                print(f"{row['case']:<36} FAILED {row['error']}")
            else:
                print(f"{row['case']:<36} {row['kernel']:<26} shared {row['shared_bytes']:>6} B  regs "
                      f"{row['registers']:>3}  stack {row['stack_bytes']:>3}  cp.async {row['async_copies']}  "
                      f"wgmma {row['wgmma']}  {row['residency']}/SM")
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
