"""Decode sweep: the tiles schedule's launch configurations against production, SDPA and copy.

One GPU call (~4 min on an H200) that answers which `DecodeTuning(schedule="tiles", ...)` is
fastest per case, and by how much, before anything is switched on:

    cases     Llama-3-8B attention (32 q / 8 kv heads, d128, bf16, page 16, shuffled pages) at
              B x L = 1 x 32768, 8 x 4096, 64 x 512, 256 x 512, 64 x 4096, then the engine
              shapes (Qwen3-0.6B 16/8 d128, SmolLM2 9/3 d64, GPT-2 12/12 d64) at 1 x 2048,
              32 x 1024 and 1 x 8192
    rivals    production (`paged_decode_attention` with the default tuning), the in-kernel
              merge, contiguous SDPA on the same K/V, and a device copy
              whose bytes read + written equal the K/V bytes
    configs   tiles tunings x programs-per-SM targets (`LLAMA_CONFIGS`, `ENGINE_CONFIGS`)

Every contender is checked against an fp32 reference on the case's data first; a config that
fails to compile or differs is recorded with its error and not timed.

Three timings, because small kernels are sensitive to what L2 holds when they start:

    rotated   (primary) one CUDA graph replays R launches, each on its own copy of the case's
              data (R x bytes >= 1 GiB, > L2), so every launch starts on a cold L2 that holds
              the previous launch's CLEAN lines, as in an engine step; median of the replays / R
    dirty     triton.testing.do_bench of a one-launch graph: what `pagedkv bench kernel`
              reports (benchmarks/results/kernel.md). do_bench flushes L2 by zeroing 256 MB,
              so the kernel starts with L2 full of DIRTY lines, and writing them back (up to
              60 MB) is charged to the kernel: a 134 MB decode pays up to ~14 us it would not
              pay in an engine step
    clean     the same one-launch graph after a read-only 256 MB flush (clean L2, no write-back)

Compilation: the tiles kernels are compiled first by a pool of worker processes (the same
launches on tiny pools with the real shapes and host ints, filling Triton's on-disk cache),
so the timed process only loads them. Results are written to `$OUT/decode_sweep.json` (and
a `.md` summary) after every measurement, so a timeout still leaves data. Never asserts.

    PYTHONPATH=src python3 benchmarks/tools/decode_sweep.py [--quick] [--budget-s 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

#: (name, (q heads, kv heads, head_dim)).
LLAMA3 = ("Llama-3-8B", (32, 8, 128))
ENGINE_MODELS = [("Qwen3-0.6B", (16, 8, 128)), ("SmolLM2-135M", (9, 3, 64)), ("GPT-2", (12, 12, 64))]
#: (batch, context) cases; the small-work ones carry the >= 80% of copy target.
LLAMA_CASES = [(1, 32768), (8, 4096), (64, 512), (256, 512), (64, 4096)]
SMALL_WORK = {(1, 32768), (8, 4096), (64, 512)}
ENGINE_CASES = [(1, 2048), (32, 1024), (1, 8192)]
PAGE = 16
ROTATION_BYTES = 2**30  # each timed graph reads >= 1 GiB of distinct K/V: far more than the 60 MB L2
MAX_ROTATIONS = 64
FLUSH_BYTES = 256 * 10**6  # what triton.testing.do_bench zeroes between calls

#: Llama-3-8B tiles configurations: (label, DecodeTuning kwargs, residency). Residency is the
#: programs per SM that fit at once, read off the kernels compiled for sm_90 by Triton 3.6 (the
#: device's version; registers and shared memory via pagedkv.kernels.offline_compile); the
#: sweep plans for 1, residency (one full wave) and 2 x residency programs per SM. "gather" /
#: "select" read the block table ahead of the K/V loop (2-3 K/V tiles in flight per program),
#: "inline" is the split kernel's per-tile table load (one tile in flight).
LLAMA_CONFIGS = [
    ("gather n64 w4 s3", {}, 3),
    ("gather n64 w4 s3, in-kernel merge", {"merge": "in_kernel"}, 3),
    ("gather n64 w4 s3 chunk256", {"table_chunk": 256}, 3),  # one read-ahead step for up to 4096 tokens
    ("gather n64 w4 s2", {"num_stages": 2}, 4),
    ("gather n64 w4 s4", {"num_stages": 4}, 2),
    ("select n64 w4 s3", {"table": "select"}, 3),
    ("inline n64 w4 s3", {"table": "inline"}, 4),
    ("inline n64 w4 s3, in-kernel merge", {"table": "inline", "merge": "in_kernel"}, 4),
    ("inline n64 w4 s5", {"table": "inline", "num_stages": 5}, 3),
    ("gather n32 w4 s3", {"block_n": 32}, 5),
    ("gather n32 w4 s3, in-kernel merge", {"block_n": 32, "merge": "in_kernel"}, 5),
    ("gather n32 w4 s4", {"block_n": 32, "num_stages": 4}, 4),
    ("gather n32 w4 s5", {"block_n": 32, "num_stages": 5}, 3),
    ("gather n32 w2 s3", {"block_n": 32, "num_warps": 2}, 6),
    ("gather n32 w2 s4", {"block_n": 32, "num_warps": 2, "num_stages": 4}, 4),
    ("gather n64 w8 s3", {"num_warps": 8}, 3),
    ("gather n64 w8 s4", {"num_warps": 8, "num_stages": 4}, 2),
    ("gather n128 w8 s2", {"block_n": 128, "num_warps": 8, "num_stages": 2}, 3),
    ("gather n128 w8 s3", {"block_n": 128, "num_warps": 8}, 1),
    ("gather h2 n32 w4 s3", {"heads_per_program": 2, "block_n": 32}, 3),
    ("gather h4 n16 w4 s3", {"heads_per_program": 4, "block_n": 16}, 3),
    ("gather h4 n16 w4 s3, in-kernel merge", {"heads_per_program": 4, "block_n": 16, "merge": "in_kernel"}, 3),
    ("gather h4 n16 w8 s3", {"heads_per_program": 4, "block_n": 16, "num_warps": 8}, 2),
    ("gather h8 n16 w8 s2", {"heads_per_program": 8, "block_n": 16, "num_warps": 8, "num_stages": 2}, 1),
    ("gather h2 n16 w2 s3", {"heads_per_program": 2, "block_n": 16, "num_warps": 2}, 6),
]
QUICK_LLAMA = {"gather n64 w4 s3", "gather n64 w4 s3, in-kernel merge", "inline n64 w4 s3", "gather n32 w4 s3",
               "gather n32 w2 s3", "gather h4 n16 w4 s3", "gather n64 w4 s4"}
#: Engine shapes: a fixed short list (compiled ahead like the rest), at 2, 4 and 8 programs per SM.
ENGINE_CONFIGS = [
    ("gather n64 w4 s3", {}),
    ("gather n64 w4 s3, in-kernel merge", {"merge": "in_kernel"}),
    ("inline n64 w4 s3", {"table": "inline"}),
    ("gather n32 w4 s3", {"block_n": 32}),
    ("gather n32 w2 s3", {"block_n": 32, "num_warps": 2}),
    ("gather n128 w4 s3", {"block_n": 128}),
    ("gather h4 n16 w4 s3", {"heads_per_program": 4, "block_n": 16}),
    ("gather h4 n32 w4 s3", {"heads_per_program": 4, "block_n": 32}),
]
ENGINE_PER_SM = (2, 4, 8)
#: The other small-work schedule, timed beside production (rotated only) for context.
OTHER_SCHEDULES = {"split, in-kernel merge": {"merge": "in_kernel"}}


def programs_per_sm_for(batch: int, seq_len: int, residency: int, quick: bool) -> list[int]:
    """The split plans to try: 1 program per SM, one full wave, two waves; one full wave for big batches
    (256 x 512 and 64 x 4096 fill the GPU without splitting, so the plan barely matters)."""
    if quick or (batch, seq_len) not in SMALL_WORK:
        return [residency]
    return sorted({1, residency, 2 * residency})


def tiles_tuning(options: dict, programs_per_sm: int):
    from pagedkv.kernels import DecodeTuning

    return DecodeTuning(schedule="tiles", programs_per_sm=programs_per_sm, **options)


# --------------------------------------------------------------------------- compile ahead (worker processes)
def _compile_group(group: dict) -> list[str]:
    """Run every launch of one (shape, tuning) group once on a tiny pool: fills Triton's disk cache.

    The pool has 64 blocks but the tables have the real shapes (all entries 0), the lengths and
    host ints are the real ones, so the kernels specialise exactly as in the timed run.
    """
    import torch

    from pagedkv.kernels import DecodeTuning, KernelWorkspace, paged_decode_attention

    num_heads, num_kv_heads, head_dim = group["heads"]
    device = torch.device(group["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k_cache = torch.zeros(64, PAGE, num_kv_heads, head_dim, dtype=dtype, device=device)
    errors = []
    for batch, seq_len, tuning_kwargs in group["launches"]:
        table = torch.zeros(batch, -(-seq_len // PAGE), dtype=torch.int32, device=device)
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        query = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=device)
        try:
            paged_decode_attention(query, k_cache, k_cache, table, lens, scale=head_dim ** -0.5, max_seq_len=seq_len,
                                   validate=False, backend="triton", tuning=DecodeTuning(**tuning_kwargs),
                                   workspace=KernelWorkspace(batch * num_kv_heads, device))
        except Exception as error:  # noqa: BLE001 - the timed run reports it again, per config
            errors.append(f"{group['heads']} {tuning_kwargs}: {type(error).__name__}: {str(error)[:200]}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return errors


def compile_groups(plan: list[dict], device) -> list[dict]:
    """One group per (shape, tuning without the plan): its launches over every case and programs-per-SM value."""
    groups: dict = {}
    for item in plan:
        key = (item["heads"], json.dumps(item["base_kwargs"], sort_keys=True))
        groups.setdefault(key, {"heads": item["heads"], "device": str(device), "launches": []})["launches"].append(
            (item["batch"], item["seq_len"], item["tuning_kwargs"]))
    return list(groups.values())


def compile_ahead(groups: list[dict], workers: int, timeout_s: float, log) -> dict:
    """Compile in `workers` spawned processes; whatever is unfinished at the timeout compiles in the timed run."""
    import multiprocessing

    started = time.perf_counter()
    if workers <= 0 or not groups:
        return {"workers": 0, "seconds": 0.0, "finished": False, "errors": []}
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(processes=min(workers, len(groups)))
    result = pool.map_async(_compile_group, groups, chunksize=1)
    finished = False
    try:
        errors = [e for group_errors in result.get(timeout=timeout_s) for e in group_errors]
        finished = True
        pool.close()
    except multiprocessing.TimeoutError:
        errors = ["compile-ahead timed out; the rest compiles in the timed run"]
        pool.terminate()
    except Exception as error:  # noqa: BLE001 - compile-ahead is an optimisation, never a failure
        errors = [f"compile-ahead failed: {type(error).__name__}: {str(error)[:200]}"]
        pool.terminate()
    pool.join()
    seconds = time.perf_counter() - started
    log(f"compile-ahead: {len(groups)} groups in {workers} processes, {seconds:.0f} s, "
        f"{'done' if finished else 'NOT finished'}, {len(errors)} errors")
    for error in errors[:10]:
        log(f"  {error}")
    return {"workers": workers, "seconds": seconds, "finished": finished, "errors": errors}


# --------------------------------------------------------------------------- timing
class Timer:
    """CUDA-graph timings: rotated (R launches per replay), dirty (do_bench) and clean (read flush).

    On CPU (`--smoke`, the Triton interpreter) every timing is a plain wall-clock median: the
    smoke run checks the script, not the numbers.
    """

    def __init__(self, device, reps: int):
        import torch

        self.torch, self.device, self.reps = torch, device, reps
        self.cuda = device.type == "cuda"
        self.flush_buffer = torch.empty(FLUSH_BYTES // 4 if self.cuda else 1, dtype=torch.int32, device=device)

    def graph(self, calls):
        """`calls` captured back to back in one CUDA graph (each already run once, so compiled)."""
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return graph

    def _median_ms(self, replay, before=None) -> float:
        if not self.cuda:
            samples = []
            for _ in range(self.reps):
                start = time.perf_counter()
                replay()
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)
        torch = self.torch
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        for _ in range(3):
            replay()
        for start, end in events:
            if before is not None:
                before()
            start.record()
            replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def _one_graph_ms(self, calls, timing) -> float:
        if not self.cuda:
            return self._median_ms(lambda: [call() for call in calls])
        graph = self.graph(calls)
        try:
            return timing(graph.replay)
        finally:
            del graph

    def rotated_ms(self, calls) -> float:
        """Median time of one graph replay of all `calls`, divided by their number."""
        return self._one_graph_ms(calls, self._median_ms) / len(calls)

    def dirty_ms(self, call) -> float:
        """do_bench of a one-call graph: L2 zeroed (dirty) before each call, as `pagedkv bench kernel` times."""
        from triton.testing import do_bench

        return self._one_graph_ms([call], lambda replay: float(do_bench(replay, warmup=5, rep=25,
                                                                           return_mode="median")))

    def clean_ms(self, call) -> float:
        """A one-call graph after a read-only flush of 256 MB: L2 holds clean lines only."""
        return self._one_graph_ms([call], lambda replay: self._median_ms(replay, before=self.flush_buffer.max))


# --------------------------------------------------------------------------- data
class CaseData:
    """R rotations of one decode case: one pool of R x B x L tokens behind R shuffled tables, plus SDPA/copy twins."""

    def __init__(self, heads, batch: int, seq_len: int, device, seed: int = 0, max_rotations: int = MAX_ROTATIONS):
        import torch

        self.heads, self.batch, self.seq_len = heads, batch, seq_len
        num_heads, num_kv_heads, head_dim = heads
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # fp32 for the interpreter
        self.kv_bytes = 2 * batch * seq_len * num_kv_heads * head_dim * dtype.itemsize
        self.rotations = max(2, min(max_rotations, math.ceil(ROTATION_BYTES / self.kv_bytes)))
        blocks_per_seq = -(-seq_len // PAGE)
        per_rotation = batch * blocks_per_seq
        generator = torch.Generator(device=device).manual_seed(seed)
        shape = (self.rotations * per_rotation, PAGE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device=device, generator=generator)
        self.v_cache = torch.randn(shape, dtype=dtype, device=device, generator=generator)
        order = torch.randperm(shape[0], device=device, generator=generator).to(torch.int32)
        self.tables = [order[r * per_rotation:(r + 1) * per_rotation].view(batch, blocks_per_seq)
                       for r in range(self.rotations)]
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        self.query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device, generator=generator)
        self.out = torch.empty_like(self.query)
        self.scale = head_dim ** -0.5

    def gathered(self, rotation: int):
        """Contiguous K, V `[B, Hkv, L, D]` of one rotation."""
        num_kv_heads, head_dim = self.heads[1], self.heads[2]
        table = self.tables[rotation].long()
        k = self.k_cache[table].view(self.batch, -1, num_kv_heads, head_dim)[:, :self.seq_len]
        v = self.v_cache[table].view(self.batch, -1, num_kv_heads, head_dim)[:, :self.seq_len]
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def reference(self):
        """fp32 attention of rotation 0, `[B, H, D]`."""
        import torch

        k, v = self.gathered(0)
        batch, num_kv_heads, _, head_dim = k.shape
        q = self.query.float().view(batch, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
        scores = torch.einsum("bhgd,bhld->bhgl", q, k.float()) * self.scale
        out = torch.einsum("bhgl,bhld->bhgd", scores.softmax(-1), v.float())
        return out.reshape(batch, -1, head_dim)


def max_abs_err(out, expected) -> float:
    diff = (out.float() - expected).abs()
    return float("inf") if bool(diff.isnan().any()) else float(diff.max())


def tbps(num_bytes: int, ms: float | None) -> float | None:
    return num_bytes / (ms * 1e-3) / 1e12 if ms else None


# --------------------------------------------------------------------------- one case
class Sweep:
    """Runs the cases, keeps the results, and rewrites the JSON / markdown after every measurement."""

    def __init__(self, args, device, log):
        import torch

        self.args, self.device, self.log = args, device, log
        self.timer = Timer(device, reps=1 if args.smoke else 10 if args.quick else 20)
        self.out_dir = Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.deadline = self.started + args.budget_s
        import triton

        from pagedkv.results import provenance
        from pagedkv.kernels.tuning import num_sms

        self.sm_count = num_sms(device)
        cuda = device.type == "cuda"
        name = torch.cuda.get_device_name(device) if cuda else "cpu (smoke: Triton interpreter)"
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None) if cuda else None
        self.result = {"benchmark": "decode_sweep", "quick": args.quick, "budget_s": args.budget_s, "device": name,
                       "sm_count": self.sm_count, "l2_bytes": l2_bytes, "torch": torch.__version__,
                       "triton": triton.__version__, "page": PAGE, "dtype": "bfloat16" if cuda else "float32",
                       "provenance": provenance(device=name), "cases": []}

    def over_budget(self) -> bool:
        return time.perf_counter() > self.deadline

    def save(self) -> None:
        self.result["elapsed_s"] = time.perf_counter() - self.started
        target = self.out_dir / "decode_sweep.json"
        temporary = target.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.result, indent=1) + "\n")
        temporary.replace(target)
        (self.out_dir / "decode_sweep.md").write_text(markdown(self.result))

    # ---------------------------------------------------------------- baselines
    def copy_bandwidth(self) -> None:
        """Large device copy, the figure '% of copy' divides by: do_bench (as kernel.md) and rotated."""
        import torch

        num_bytes = 2**30 if self.device.type == "cuda" else 2**20
        pairs = [(torch.empty(num_bytes, dtype=torch.uint8, device=self.device),
                  torch.empty(num_bytes, dtype=torch.uint8, device=self.device)) for _ in range(2)]
        calls = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
        for call in calls:
            call()
        dirty = self.timer.dirty_ms(calls[0])
        rotated = self.timer.rotated_ms(calls)
        self.result["copy_large"] = {"bytes": 2 * num_bytes, "dirty_tbps": tbps(2 * num_bytes, dirty),
                                     "rotated_tbps": tbps(2 * num_bytes, rotated)}
        self.copy_tbps = self.result["copy_large"]["dirty_tbps"]
        self.log(f"copy 1 GiB -> 1 GiB: {self.copy_tbps:.2f} TB/s (do_bench), "
                 f"{self.result['copy_large']['rotated_tbps']:.2f} TB/s (rotated)")
        del pairs, calls
        self.save()

    def _measure(self, record: dict, calls, expected, data, extra: bool) -> dict:
        """Check rotation 0 against the reference, then time (rotated; dirty and clean when `extra`)."""
        try:
            out = calls[0]()
            if expected is not None:
                record["max_abs_err"] = max_abs_err(out, expected)
                record["ok"] = record["max_abs_err"] <= 2e-2
                if not record["ok"]:
                    record["error"] = f"differs from the reference by {record['max_abs_err']:.2e}"
                    return record
            record["rotated_ms"] = self.timer.rotated_ms(calls)
            record["tbps"] = tbps(data.kv_bytes, record["rotated_ms"])
            if extra:
                self._extra_timings(record, calls[0], data)
        except Exception as error:  # noqa: BLE001 - a sweep records a failure, it never stops
            text = str(error).strip().splitlines()
            record["ok"], record["error"] = False, f"{type(error).__name__}: {text[0][:160] if text else ''}"
        return record

    def _extra_timings(self, record: dict, call, data) -> None:
        record["dirty_ms"] = self.timer.dirty_ms(call)
        record["clean_ms"] = self.timer.clean_ms(call)
        record["dirty_tbps"] = tbps(data.kv_bytes, record["dirty_ms"])
        record["clean_tbps"] = tbps(data.kv_bytes, record["clean_ms"])

    def baselines(self, data, expected) -> dict:
        import torch
        import torch.nn.functional as F

        from pagedkv.kernels import DecodeTuning, KernelWorkspace, choose_num_splits, paged_decode_attention

        workspace = KernelWorkspace(data.batch * data.heads[1], self.device)
        production = [lambda t=t: paged_decode_attention(
            data.query, data.k_cache, data.v_cache, t, data.seq_lens, scale=data.scale, max_seq_len=data.seq_len,
            out=data.out, validate=False, backend="triton", workspace=workspace) for t in data.tables]
        rows = {"production": self._measure(
            {"label": "production (default DecodeTuning)",
             "num_splits": choose_num_splits(data.batch, data.heads[1], data.seq_len, self.sm_count)},
            production, expected, data, extra=True)}
        for label, options in OTHER_SCHEDULES.items():
            tuning = DecodeTuning(**options)
            calls = [lambda t=t: paged_decode_attention(
                data.query, data.k_cache, data.v_cache, t, data.seq_lens, scale=data.scale, max_seq_len=data.seq_len,
                out=data.out, validate=False, backend="triton", tuning=tuning, workspace=workspace)
                for t in data.tables]
            rows[label] = self._measure({"label": label}, calls, expected, data, extra=False)
        twins = [data.gathered(r) for r in range(data.rotations)]
        query = data.query.unsqueeze(2)
        sdpa = [lambda k=k, v=v: F.scaled_dot_product_attention(query, k, v, enable_gqa=True).squeeze(2)
                for k, v in twins]
        rows["sdpa"] = self._measure({"label": "contiguous SDPA"}, sdpa, expected, data, extra=True)
        del twins, sdpa
        half = data.kv_bytes // 2
        pairs = [(torch.empty(half, dtype=torch.uint8, device=self.device),
                  torch.empty(half, dtype=torch.uint8, device=self.device)) for _ in range(data.rotations)]
        copies = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
        rows["copy"] = self._measure({"label": "copy of the same bytes (read + write = K/V bytes)"}, copies, None,
                                     data, extra=True)
        del pairs, copies
        return rows

    # ---------------------------------------------------------------- configs
    def run_case(self, model: str, heads, batch: int, seq_len: int, configs, essential: set) -> None:
        import torch

        from pagedkv.kernels import KernelWorkspace, paged_decode_attention
        from pagedkv.kernels.triton_decode_tiles import tiles_launch_config

        data = CaseData(heads, batch, seq_len, self.device, max_rotations=2 if self.args.smoke else MAX_ROTATIONS)
        expected = data.reference()
        case = {"model": model, "heads": list(heads), "batch": batch, "seq_len": seq_len, "kv_bytes": data.kv_bytes,
                "rotations": data.rotations, "small_work": (batch, seq_len) in SMALL_WORK and model == LLAMA3[0],
                "configs": []}
        self.result["cases"].append(case)
        case["baselines"] = self.baselines(data, expected)
        base = case["baselines"]
        self.log(f"{model} B={batch} L={seq_len} ({data.kv_bytes / 1e6:.0f} MB, R={data.rotations}): production "
                 f"{fmt(base['production'].get('tbps'))} TB/s, SDPA {fmt(base['sdpa'].get('tbps'))}, copy "
                 f"{fmt(base['copy'].get('tbps'))} (rotated); dirty: production "
                 f"{fmt(base['production'].get('dirty_tbps'))}, SDPA {fmt(base['sdpa'].get('dirty_tbps'))}, copy "
                 f"{fmt(base['copy'].get('dirty_tbps'))}")
        self.save()
        workspace = KernelWorkspace(batch * heads[1], self.device)
        for label, options, programs_per_sm in configs:
            record = {"label": label, "tuning": options, "programs_per_sm": programs_per_sm}
            case["configs"].append(record)
            if self.over_budget() and (label, programs_per_sm) not in essential:
                record.update(ok=False, error="skipped (time budget)")
                continue
            tuning = tiles_tuning(options, programs_per_sm)
            plan = tiles_launch_config(batch, heads[0], heads[2], PAGE, heads[1], seq_len, None, self.sm_count, tuning)
            record.update(num_splits=plan["num_splits"], split_tokens=plan["split_tokens"],
                          programs=math.prod(plan["grid"]))
            calls = [lambda t=t: paged_decode_attention(
                data.query, data.k_cache, data.v_cache, t, data.seq_lens, scale=data.scale, max_seq_len=seq_len,
                out=data.out, validate=False, backend="triton", tuning=tuning, workspace=workspace)
                for t in data.tables]
            self._measure(record, calls, expected, data, extra=False)
            self.log(f"  {label:<40} {programs_per_sm}/SM splits {plan['num_splits']:>3} programs "
                     f"{record['programs']:>5}: {fmt(record.get('tbps'))} TB/s {record.get('error', '')}")
            self.save()
        # The best config again under the two one-launch timings, beside the baselines'.
        timed = [r for r in case["configs"] if r.get("rotated_ms")]
        if timed:
            timed.sort(key=lambda r: r["rotated_ms"])
            best = timed[0]
            best_tuning = tiles_tuning(best["tuning"], best["programs_per_sm"])

            def call():
                return paged_decode_attention(data.query, data.k_cache, data.v_cache, data.tables[0], data.seq_lens,
                                              scale=data.scale, max_seq_len=seq_len, out=data.out, validate=False,
                                              backend="triton", tuning=best_tuning, workspace=workspace)
            try:
                self._extra_timings(best, call, data)
            except Exception as error:  # noqa: BLE001 - a sweep records a failure, it never stops
                best["error"] = f"extra timings: {type(error).__name__}"
            case["best"] = summarize(case, best, self.copy_tbps)
            case["top"] = [{"label": r["label"], "programs_per_sm": r["programs_per_sm"], "tbps": r["tbps"]}
                           for r in timed[:5]]
            self.log(f"  best: {case['best']['text']}")
        try:
            workspace.check_integrity()
        except AssertionError as error:  # an in-kernel merge left a counter set: every later call is wrong
            case["workspace_error"] = str(error)
            self.log(f"  WORKSPACE: {error}")
        self.save()
        del data, expected
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def summarize(case: dict, best: dict, copy_tbps: float) -> dict:
    """The best config's figures against copy, production and SDPA (rotated; dirty alongside)."""
    base = case["baselines"]

    def ratio(a, b, scale=1.0):
        return scale * a / b if a and b else None

    summary = {
        "label": best["label"], "programs_per_sm": best["programs_per_sm"], "num_splits": best.get("num_splits"),
        "tbps": best["tbps"], "pct_copy": ratio(best["tbps"], copy_tbps, 100),
        "pct_same_bytes_copy": ratio(best["tbps"], base["copy"].get("tbps"), 100),
        "vs_production": ratio(best["tbps"], base["production"].get("tbps")),
        "vs_sdpa": ratio(best["tbps"], base["sdpa"].get("tbps")),
        "dirty_tbps": best.get("dirty_tbps"), "clean_tbps": best.get("clean_tbps"),
        "dirty_pct_copy": ratio(best.get("dirty_tbps"), copy_tbps, 100),
        "dirty_vs_production": ratio(best.get("dirty_tbps"), base["production"].get("dirty_tbps")),
        "dirty_vs_sdpa": ratio(best.get("dirty_tbps"), base["sdpa"].get("dirty_tbps")),
    }
    summary["text"] = (f"{best['label']} @ {best['programs_per_sm']}/SM: {fmt(summary['tbps'])} TB/s rotated = "
                       f"{fmt(summary['pct_copy'], '.0f')}% of copy, {fmt(summary['vs_production'])}x production, "
                       f"{fmt(summary['vs_sdpa'])}x SDPA; dirty {fmt(summary['dirty_tbps'])} TB/s = "
                       f"{fmt(summary['dirty_pct_copy'], '.0f')}%, clean {fmt(summary['clean_tbps'])}")
    return summary


def fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    """The summary tables: per case the best config and the baselines under each timing."""
    copy = result.get("copy_large", {})
    lines = [f"# Decode sweep ({result['device']}, torch {result['torch']}, triton {result['triton']})", "",
             f"Large copy: {fmt(copy.get('dirty_tbps'))} TB/s (do_bench), {fmt(copy.get('rotated_tbps'))} TB/s "
             "(rotated). TB/s = K/V bytes / time. 'rotated': R launches on distinct data per graph replay "
             "(clean, cold L2); 'dirty': do_bench, L2 zeroed before each call (= kernel.md); 'clean': read flush.",
             "", "| model | B x L | best tiles config | /SM | splits | TB/s | % copy | % same-bytes copy | vs prod | "
             "vs SDPA | prod TB/s | SDPA TB/s | copy TB/s | best dirty | prod dirty | SDPA dirty | copy dirty | "
             "best clean | prod clean |", "|" + "---|" * 19]
    for case in result["cases"]:
        base, best = case.get("baselines", {}), case.get("best", {})

        def cell(name, key):
            return fmt(base.get(name, {}).get(key))

        lines.append(" | ".join([
            f"| {case['model']}", f"{case['batch']} x {case['seq_len']}", best.get("label", "n/a"),
            str(best.get("programs_per_sm", "")), str(best.get("num_splits", "")), fmt(best.get("tbps")),
            fmt(best.get("pct_copy"), ".0f"), fmt(best.get("pct_same_bytes_copy"), ".0f"),
            fmt(best.get("vs_production")), fmt(best.get("vs_sdpa")), cell("production", "tbps"),
            cell("sdpa", "tbps"), cell("copy", "tbps"), fmt(best.get("dirty_tbps")), cell("production", "dirty_tbps"),
            cell("sdpa", "dirty_tbps"), cell("copy", "dirty_tbps"), fmt(best.get("clean_tbps")),
            cell("production", "clean_tbps")]) + " |")
    lines += ["", "## Top 5 per case (rotated TB/s)", ""]
    for case in result["cases"]:
        top = "; ".join(f"{r['label']} @ {r['programs_per_sm']}/SM {fmt(r['tbps'])}" for r in case.get("top", []))
        lines.append(f"- {case['model']} {case['batch']} x {case['seq_len']}: {top or 'n/a'}")
    lines += ["", "## Every config (rotated TB/s)", ""]
    for case in result["cases"]:
        lines.append(f"### {case['model']} B={case['batch']} L={case['seq_len']}")
        lines.append("")
        lines.append("| config | /SM | splits | programs | TB/s | note |")
        lines.append("|---|---|---|---|---|---|")
        for name, r in case.get("baselines", {}).items():
            lines.append(f"| {r['label']} | | {r.get('num_splits', '')} | | {fmt(r.get('tbps'))} | "
                         f"{r.get('error', '')} |")
        for r in case["configs"]:
            lines.append(f"| {r['label']} | {r['programs_per_sm']} | {r.get('num_splits', '')} | "
                         f"{r.get('programs', '')} | {fmt(r.get('tbps'))} | {r.get('error', '')} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main
def build_plan(args) -> tuple[list[tuple], list[dict]]:
    """(cases to run, launches to compile ahead). A case: (model, heads, B, L, configs, essential)."""
    cases, launches = [], []
    llama_configs = [c for c in LLAMA_CONFIGS if not (args.quick or args.smoke) or c[0] in QUICK_LLAMA]
    engine_configs = ENGINE_CONFIGS[:4] if args.quick or args.smoke else ENGINE_CONFIGS
    # (model, heads, B, L, whether the Llama config list applies)
    work = [(LLAMA3[0], LLAMA3[1], b, s, True) for b, s in LLAMA_CASES]
    engine_cases = ENGINE_CASES[:2] if args.quick else ENGINE_CASES
    work += [(name, heads, b, s, False) for name, heads in ENGINE_MODELS for b, s in engine_cases]
    if args.smoke:  # tiny shapes for the interpreter: the script's logic, not its numbers
        llama_configs, engine_configs = llama_configs[:2], engine_configs[:2]
        work = [("tiny GQA", (8, 2, 64), 1, 520, True), ("tiny MHA", (2, 2, 64), 1, 33, False)]
    for model, heads, batch, seq_len, llama_list in work:
        if args.cases and f"{batch}x{seq_len}" not in args.cases.split(","):
            continue
        if llama_list:
            configs = [(label, options, p) for label, options, residency in llama_configs
                       for p in programs_per_sm_for(batch, seq_len, residency, args.quick or args.smoke)]
        else:
            per_sm = ENGINE_PER_SM[1:2] if args.quick or args.smoke else ENGINE_PER_SM
            configs = [(label, options, p) for label, options in engine_configs for p in per_sm]
        essential = {(configs[0][0], configs[0][2])} if configs else set()  # runs even past the budget
        cases.append((model, heads, batch, seq_len, configs, essential))
        for label, options, programs_per_sm in configs:
            launches.append({"heads": heads, "batch": batch, "seq_len": seq_len, "base_kwargs": options,
                             "tuning_kwargs": {"schedule": "tiles", "programs_per_sm": programs_per_sm, **options}})
        for options in [{}, *OTHER_SCHEDULES.values()]:  # production and the other small-work schedules
            launches.append({"heads": heads, "batch": batch, "seq_len": seq_len,
                             "base_kwargs": {"production": True, **options}, "tuning_kwargs": options})
    return cases, launches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="directory for decode_sweep.json/.md")
    parser.add_argument("--quick", action="store_true", help="a few configs, one plan each, fewer replays")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="past this many seconds only each case's baselines and first config still run")
    parser.add_argument("--workers", type=int, default=max(0, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling ahead (0: compile in the timed run)")
    parser.add_argument("--compile-timeout-s", type=float, default=75.0)
    parser.add_argument("--cases", default="", help="comma-separated BxL filter, e.g. 1x32768,64x512")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the script, not the GPU")
    args = parser.parse_args(argv)

    import torch

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    if torch.cuda.is_available() and not args.smoke:
        device = torch.device("cuda")
    elif args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        log("decode_sweep needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1 on CPU)")
        return 1
    cases, launches = build_plan(args)
    compiled = compile_ahead(compile_groups(launches, device), args.workers, args.compile_timeout_s, log)
    sweep = Sweep(args, device, log)
    sweep.deadline = started + args.budget_s  # the budget counts the compile-ahead too
    sweep.result["compile_ahead"] = compiled
    sweep.copy_bandwidth()
    for model, heads, batch, seq_len, configs, essential in cases:
        sweep.run_case(model, heads, batch, seq_len, configs, essential)
    sweep.save()
    log(f"wrote {sweep.out_dir / 'decode_sweep.json'} and decode_sweep.md")
    print(markdown(sweep.result).split("## Every config")[0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
