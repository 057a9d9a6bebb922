"""Host time per decode step of the cache + attention path, PagedCache against DynamicCache. Prints a table.

Only what the cache choice changes is timed: per layer, `cache.update` and the attention
function (the model's projections, norms and MLP are the same for every cache). GPT-2 124M
shape (12 layers, 12 heads of 64), from a 10-token prompt. Three paths:

    DynamicCache + sdpa      torch.cat of K and V, then SDPA
    PagedCache, unfused      index_copy_ of K and V into pages, then the paged decode kernel
    PagedCache, fused        one fused K/V write + decode launch, bound (`kernels.launch`)

On CUDA everything runs as is (host time measured, the GPU synchronized once per step as
generate does). Without CUDA nothing can be launched, so host time is approximated:

- the launches are stubbed where they leave Python: the unfused path's at Triton's
  `kernel[grid](...)` (off CUDA its launch is never bound; on the H200 host it is),
  the fused path's at the C launcher call (which costs a few us there);
- DynamicCache's tensors are dispatch-sized (1 KV head of 8 dims, same layers and steps):
  on CPU `torch.cat` and SDPA run synchronously, so full-size tensors would time the copy
  and the math, which on a GPU run behind the host; what is left is each op's dispatch;
- torch runs one CPU thread, so no op pays for an intra-op parallel region a GPU run lacks.

    PYTHONPATH=src python benchmarks/tools/hf_host_overhead.py [--batch 1 32] [--device cuda|cpu]
"""

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("PAGEDKV_KERNEL_BACKEND", "triton")  # the Triton paths also off CUDA (launches stubbed)

from transformers import DynamicCache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import pagedkv.hf.attention as attention  # noqa: E402
from pagedkv.hf import PagedCache, PagePool  # noqa: E402

NUM_LAYERS, NUM_HEADS, HEAD_DIM, PROMPT_LEN = 12, 12, 64, 10


class _Layer:
    """What the attention functions read of an HF attention module."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx
        self.sliding_window = None
        self.is_causal = True
        self.num_key_value_groups = 1


class _NoLaunch:
    """Stands in for a JIT function off CUDA: `fn[grid](...)` returns a compiled kernel whose C launch does nothing."""

    class _Launcher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        @staticmethod
        def launch(*args):
            return None

    class _Compiled:
        function = 1
        packed_metadata = (4, 1, 0)

    def __init__(self):
        self._compiled = self._Compiled()
        self._compiled.run = self._Launcher()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._compiled


def _stub_launches(pool: PagePool) -> None:
    """Off CUDA: the unfused path's Triton launch and the fused path's C launch become no-ops (see the docstring)."""
    from triton import knobs

    import pagedkv.kernels.triton_decode as triton_decode
    from pagedkv.kernels.launch import BoundConfig

    stub = _NoLaunch()
    stub.arg_names = triton_decode._decode_kernel.arg_names  # the bound launch path reads the signature
    triton_decode._decode_kernel = stub
    bound = pool.decode_write_kernel().kernel
    make = bound.config

    def config(**kwargs) -> BoundConfig:
        made = make(**kwargs)
        if not isinstance(made.fn, _NoLaunch):
            made.bindable, made.fn, made._runtime = True, _NoLaunch(), knobs.runtime
            made._current_device, made._current_stream = (lambda: 0), (lambda device: 0)
        return made

    bound.config = config


def _round_us(run_step, steps: int, sync) -> float:
    """The median host time of one decode step over one run of `steps` steps (us)."""
    state = run_step(None)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state = run_step(state)
        times.append(time.perf_counter() - start)
        sync()
    if isinstance(state, PagedCache):
        state.free()
    return statistics.median(times[20:]) * 1e6


def per_step_us(batch: int, device: str, steps: int = 200, rounds: int = 5) -> dict[str, float]:
    """Host us per decode step of each path: the best over `rounds` of each run's median."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    layers = [_Layer(i) for i in range(NUM_LAYERS)]
    # GPT-2's q/k/v: [batch, heads, 1, head_dim] views of one fused projection.
    fused = torch.randn(batch, 1, 3 * NUM_HEADS * HEAD_DIM, dtype=dtype, device=device)
    q, k, v = (t.view(batch, 1, NUM_HEADS, HEAD_DIM).transpose(1, 2) for t in fused.split(NUM_HEADS * HEAD_DIM, 2))
    mask = torch.ones(batch, PROMPT_LEN, device=device)
    # Off CUDA, DynamicCache's tensors are dispatch-sized (see the module docstring).
    heads, dim = (NUM_HEADS, HEAD_DIM) if device == "cuda" else (1, 8)
    dq, dk, dv = (t[:, :heads, :, :dim] for t in (q, k, v))

    def dynamic_step(cache):
        if cache is None:
            cache = DynamicCache()
            prompt = torch.randn(batch, heads, PROMPT_LEN, dim, dtype=dtype, device=device)
            for layer in layers:
                cache.update(prompt, prompt, layer.layer_idx)
            return cache
        for layer in layers:
            key, value = cache.update(dk, dv, layer.layer_idx)
            sdpa_attention_forward(layer, dq, key, value, None, dropout=0.0, scaling=0.125)
        return cache

    pool = PagePool(NUM_LAYERS, NUM_HEADS, HEAD_DIM, num_blocks=batch * (steps + 64) // 16 + 64, block_size=16,
                    dtype=dtype, device=device)
    if device != "cuda":
        _stub_launches(pool)

    def paged_step(fuse: bool):
        def step(cache):
            if cache is not None:
                for layer in layers:
                    key, value = cache.update(k, v, layer.layer_idx)
                    attention.paged_attention_forward(layer, q, key, value, mask, scaling=0.125, dropout=0.0)
                return cache
            cache = PagedCache(pool)
            if not fuse:
                cache._decode_kernel = None  # write_kv's index_copy_, then the paged decode kernel
            return cache
        return step

    paths = {"DynamicCache + sdpa" + ("" if device == "cuda" else " (dispatch-sized)"): dynamic_step,
             "PagedCache, unfused": paged_step(False), "PagedCache, fused + bound": paged_step(True)}
    rounds_us: dict[str, list[float]] = {name: [] for name in paths}
    with torch.no_grad():
        for _ in range(rounds):  # paths take turns, so a shared machine's load drifts over all of them alike
            for name, run_step in paths.items():
                rounds_us[name].append(_round_us(run_step, steps, sync))
        pool.check_integrity()
    return {name: min(values) for name, values in rounds_us.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device != "cuda":
        torch.set_num_threads(1)
    print(f"device {args.device}; host us per decode step (cache + attention of {NUM_LAYERS} layers)")
    print("| batch | path | us / step | us / layer |\n|---:|---|---:|---:|")
    for batch in args.batch:
        for path, us in per_step_us(batch, args.device).items():
            print(f"| {batch} | {path} | {us:.0f} | {us / NUM_LAYERS:.1f} |")


if __name__ == "__main__":
    main()
