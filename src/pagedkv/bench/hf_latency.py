"""`pagedkv bench hf` latency: PagedCache against DynamicCache per decode step of `model.generate`, and its tail.

The target: PagedCache's decode latency is at most 1.0x DynamicCache's, at P50
and at P99, at batch 1 and at batch 32, for GPT-2 124M in fp16 and for a Llama-3.2-1B shape
in bf16 (GQA 32:8), random weights of the real shapes. Each cache runs `repeats` timed
generate calls of `steps` new tokens after one untimed call (kernels, launch bindings and
the allocator warm up there). A sample is one decode step's wall time: the interval between
two calls of a stopping criterion, which generate makes after its per-step sync.

Where the time and the tail go, per (model, batch, cache):

    GPU busy/step    kernel time per decode step (torch.profiler, outside the timed runs): a step
                     whose wall time is far above it is host-bound
    syncs/step       operations that wait for the GPU (torch.cuda.set_sync_debug_mode, outside the
                     timed runs), and the source lines that make them
    allocs/step      caching-allocator requests per generated token over the timed runs (the
                     prefill's included), and the device allocations (cudaMalloc) and retries
    GC               Python collections during the timed runs (per generation), the longest pause,
                     and how many of the slowest 1% of steps overlapped one
    block boundary   how many of the slowest 1% of steps wrote the first token of a 16-token block
    launches         PagedCache's fused decode kernel launches during the timed runs: bound, or
                     through Triton's own launcher (~58 us of host time each, per layer)

`gc_mode` "freeze" (gc.freeze() once, as servers do after start-up) or "off" (collections
disabled while timing) tests whether the collector makes the tail.
"""

from __future__ import annotations

import collections
import gc
import statistics
import time
import warnings

import torch

#: Latency models: name -> (RANDOM_CONFIGS key, dtype, label).
LATENCY_MODELS = {
    "gpt2": ("gpt2", torch.float16, "GPT-2 124M fp16"),
    "llama3.2-1b": ("llama3.2-1b", torch.bfloat16, "Llama-3.2-1B shape bf16 (GQA 32:8)"),
}
GC_MODES = ("on", "freeze", "off")


def prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """`[batch, prompt_len]` random token ids (unpadded)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=gen)


def generate_tokens(model, ids, cache, steps: int, criterion=None, **kwargs):
    """Greedy generate of exactly `steps` new tokens into `cache` (no EOS, no compile)."""
    from transformers import StoppingCriteriaList

    criteria = StoppingCriteriaList([criterion]) if criterion is not None else None
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False, past_key_values=cache, pad_token_id=0, eos_token_id=None,
                          stopping_criteria=criteria, disable_compile=True, **kwargs)


class _Clock:
    """A stopping criterion that only records when generate finished each step (after its sync)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class GcWatch:
    """Python garbage collections while `active`: count per generation and each pause's (start, end)."""

    def __init__(self):
        self.active = False
        self.collections = [0, 0, 0]
        self.pauses: list[tuple[float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.pauses.append((self._start, time.perf_counter()))


def _cache_makers(model, pool, max_cache_len: int, with_static: bool) -> dict:
    from transformers import DynamicCache, StaticCache

    from pagedkv.hf.cache import PagedCache

    makers = {"DynamicCache": ("sdpa", DynamicCache)}
    if with_static:
        makers["StaticCache"] = ("sdpa", lambda: StaticCache(config=model.config, max_cache_len=max_cache_len))
    makers["PagedCache"] = ("pagedkv", lambda: _paged(pool, fused=True))  # the default: fused decode + write
    makers["PagedCache unfused"] = ("pagedkv", lambda: _paged(pool, fused=False))
    return makers


def _paged(pool, fused: bool):
    """A PagedCache with the fused decode kernel on or off (the pool's switch, set per cache made)."""
    from pagedkv.hf.cache import PagedCache

    pool.fused_decode = fused
    return PagedCache(pool)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocator_counts(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return {"allocs": stats.get("allocation.all.allocated", 0), "cuda_mallocs": stats.get("segment.all.allocated", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def _timed_runs(model, ids, make, steps: int, repeats: int, gc_mode: str, launch_counts) -> dict:
    """`repeats` (>= 1) timed generate calls after an untimed one: samples, GC, allocator and launch counts."""
    samples: list[tuple[float, int, float, float]] = []  # (ms, decode step, start, end)
    device = model.device
    watch = GcWatch()
    gc.callbacks.append(watch)
    try:
        for repeat in range(repeats + 1):
            cache = make()
            clock = _Clock()
            if repeat == 1:
                _synchronize(device)
                allocator_before, launches_before = _allocator_counts(device), launch_counts()
            if repeat and gc_mode == "off":
                gc.disable()
            watch.active = bool(repeat)
            try:
                generate_tokens(model, ids, cache, steps, clock)
                _synchronize(device)
            finally:
                watch.active = False
                gc.enable()
            if hasattr(cache, "free"):
                cache.free()
            if repeat:  # the first call warms up kernels, bindings and the allocator
                samples += [((b - a) * 1e3, step, a, b) for step, (a, b) in
                            enumerate(zip(clock.times[1:], clock.times[2:]), start=2)]
    finally:
        gc.callbacks.remove(watch)
    allocator_after, launches_after = _allocator_counts(device), launch_counts()
    return {"samples": samples, "gc": watch, "num_tokens": repeats * steps,
            "allocator": {k: allocator_after[k] - allocator_before[k] for k in allocator_after},
            "launches": [after - before for before, after in zip(launches_before, launches_after)]}


def _gpu_busy_ms_per_step(model, ids, make, steps: int) -> float:
    """Kernel time per decode step: (busy(steps) - busy(1)) / (steps - 1), so the prefill drops out."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def busy_ms(num_tokens: int) -> float:
        cache = make()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate_tokens(model, ids, cache, num_tokens)
            torch.cuda.synchronize()
        if hasattr(cache, "free"):
            cache.free()
        # Device-side events only: a CPU op's device time counts its kernels again.
        return sum(event.device_time_total for event in prof.events() if event.device_type == DeviceType.CUDA) / 1e3

    return (busy_ms(steps) - busy_ms(1)) / (steps - 1)


def _syncs(model, ids, make, steps: int) -> dict:
    """Synchronizing CUDA operations in one generate call: per decode step, and the source lines that made most."""
    cache = make()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            generate_tokens(model, ids, cache, steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if hasattr(cache, "free"):
        cache.free()
    sites = collections.Counter(f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return {"per_step": sum(sites.values()) / steps, "top_sites": sites.most_common(4)}


def _summary(run: dict, prompt_len: int, block_size: int) -> dict:
    samples = sorted(run["samples"])
    times = [ms for ms, _, _, _ in samples]
    tail = samples[int(0.99 * (len(samples) - 1)):]
    pauses = run["gc"].pauses
    in_gc = sum(any(start < b and a < end for start, end in pauses) for _, _, a, b in tail)
    allocator = run["allocator"]
    return {"p50_ms": statistics.median(times), "p99_ms": times[int(0.99 * (len(times) - 1))],
            "mean_ms": statistics.fmean(times), "num_samples": len(times),
            "tail_steps": [step for _, step, _, _ in tail],
            "tail_at_block_boundary": sum((prompt_len + step) % block_size == 1 for _, step, _, _ in tail),
            "tail_in_gc": in_gc, "gc_collections": run["gc"].collections,
            "gc_max_pause_ms": max(((end - start) * 1e3 for start, end in pauses), default=0.0),
            "allocs_per_step": allocator["allocs"] / run["num_tokens"], "cuda_mallocs": allocator["cuda_mallocs"],
            "alloc_retries": allocator["alloc_retries"]}


def measure(model, pool, batch: int, prompt_len: int, steps: int, repeats: int, gc_mode: str = "on",
            with_static: bool = True, diagnose: bool = True) -> dict:
    """Per cache: P50/P99 per decode step (ms) and the diagnostics of the module docstring (profiler and sync
    counts on CUDA only; the rest runs anywhere)."""
    ids = prompts(batch, prompt_len, model.config.vocab_size).to(model.device)
    kernel = pool.decode_write_kernel().kernel
    result = {}
    for name, (attn, make) in _cache_makers(model, pool, prompt_len + steps + 1, with_static).items():
        model.set_attn_implementation(attn)
        counts = (lambda: kernel.launch_counts) if name == "PagedCache" else (lambda: (0, 0))
        timed = _timed_runs(model, ids, make, steps, repeats, gc_mode, counts)
        row = _summary(timed, prompt_len, pool.block_size)
        if name == "PagedCache":
            row["bound_launches"], row["triton_launches"] = timed["launches"]
        if diagnose and model.device.type == "cuda":
            row["gpu_busy_ms_per_step"] = _gpu_busy_ms_per_step(model, ids, make, min(steps, 32))
            row["syncs"] = _syncs(model, ids, make, min(steps, 32))
        result[name] = row
    model.set_attn_implementation("pagedkv")
    return result


def targets(latency: dict) -> dict:
    """Per model and batch: PagedCache's P50 and P99 over DynamicCache's, and whether both are <= 1.0."""
    out = {}
    for model_name, batches in latency.items():
        for batch, rows in batches.items():
            paged, dynamic = rows["PagedCache"], rows["DynamicCache"]
            p50, p99 = paged["p50_ms"] / dynamic["p50_ms"], paged["p99_ms"] / dynamic["p99_ms"]
            out.setdefault(model_name, {})[batch] = {"p50_ratio": p50, "p99_ratio": p99,
                                                     "met": p50 <= 1.0 and p99 <= 1.0}
    return out


def table_lines(latency: dict, labels: dict[str, str]) -> list[str]:
    """The latency table in markdown: every cache side by side with DynamicCache, each target met or missed."""
    lines = ["| model | batch | cache | P50 ms | P99 ms | P50 / P99 vs Dynamic | target <= 1.0x | GPU busy ms/step | "
             "GC gen0/1/2 (max ms) | slowest 1%: in GC / at block start | allocs/step (cudaMalloc) | syncs/step | "
             "fused launches bound / Triton |",
             "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for model_name, batches in latency.items():
        for batch, rows in batches.items():
            dynamic = rows["DynamicCache"]
            for name, row in rows.items():
                met = row["p50_ms"] <= dynamic["p50_ms"] and row["p99_ms"] <= dynamic["p99_ms"]
                verdict = ("met" if met else "**missed**") if name.startswith("PagedCache") else ""
                busy = "" if "gpu_busy_ms_per_step" not in row else f"{row['gpu_busy_ms_per_step']:.3f}"
                syncs = "" if "syncs" not in row else f"{row['syncs']['per_step']:.1f}"
                launches = f"{row['bound_launches']} / {row['triton_launches']}" if "bound_launches" in row else ""
                gc_counts = "/".join(map(str, row["gc_collections"]))
                lines.append(
                    f"| {labels[model_name]} | {batch} | {name} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | "
                    f"{row['p50_ms'] / dynamic['p50_ms']:.2f}x / {row['p99_ms'] / dynamic['p99_ms']:.2f}x | "
                    f"{verdict} | "
                    f"{busy} | {gc_counts} ({row['gc_max_pause_ms']:.1f}) | "
                    f"{row['tail_in_gc']} / {row['tail_at_block_boundary']} of {len(row['tail_steps'])} | "
                    f"{row['allocs_per_step']:.0f} ({row['cuda_mallocs']}) | {syncs} | {launches} |")
    return lines


def run(model_names: list[str], batches: list[int], prompt_len: int, steps: int, repeats: int, gc_mode: str,
        budget: int, with_static: bool = True, diagnose: bool = True, device: str = "cuda") -> tuple[dict, dict]:
    """Measure every (model, batch); returns (latency by model and batch, labels)."""
    from pagedkv.hf.cache import PagePool
    from pagedkv.models.loader import random_model

    latency, labels = {}, {}
    frozen = gc_mode == "freeze"
    for model_name in model_names:
        config_name, dtype, labels[model_name] = LATENCY_MODELS[model_name]
        model = random_model(config_name, dtype, device)
        pool = PagePool.for_model(model, num_blocks=max(batches) * budget // 16 * 2, block_size=16)
        if frozen:
            gc.collect()
            gc.freeze()  # what a server does after start-up (vLLM does): collections then skip the model's objects
        try:
            latency[model_name] = {str(batch): measure(model, pool, batch, prompt_len, steps, repeats, gc_mode,
                                                       with_static, diagnose) for batch in batches}
        finally:
            if frozen:
                gc.unfreeze()
        del model, pool
        torch.cuda.empty_cache()
    return latency, labels
