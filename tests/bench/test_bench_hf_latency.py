"""The latency part of `pagedkv bench hf` runs end to end on CPU with a tiny model (torch path).

The GPU run happens on a lent H200, so the script itself must not be what fails there.
Timings on CPU mean nothing; the test checks the report's structure and counts, never a time.
"""

import gc

import pytest
import torch

from pagedkv.bench import hf_latency
from pagedkv.hf import PagePool, random_model


@pytest.mark.parametrize("gc_mode, backend", [("on", "torch"), ("off", "triton")])
def test_measure_reports_every_cache_and_diagnostic(gc_mode, backend, monkeypatch):
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", backend)  # triton: the fused decode kernel, interpreted
    model = random_model("tiny-gpt2", torch.float32)
    pool = PagePool.for_model(model, num_blocks=64, block_size=16)
    steps, repeats = 4, 2  # the interpreted kernel makes each step slow: few steps, still 2 samples per repeat
    latency = {"tiny": {str(batch): hf_latency.measure(model, pool, batch, 5, steps, repeats, gc_mode)
                        for batch in (1, 2)}}
    assert gc.isenabled()  # "off" re-enables the collector after timing
    rows = latency["tiny"]["2"]
    assert list(rows) == ["DynamicCache", "StaticCache", "PagedCache", "PagedCache unfused"]
    for row in rows.values():
        # The first interval (prefill to first decode) is not a decode step's sample.
        assert row["num_samples"] == repeats * (steps - 2) and row["p50_ms"] <= row["p99_ms"]
        assert len(row["tail_steps"]) >= 1 and row["tail_in_gc"] <= len(row["tail_steps"])
        assert len(row["gc_collections"]) == 3 and row["cuda_mallocs"] == 0  # no allocator off CUDA
    # Timed decode steps: (steps - 1) forwards after the prefill per generate call, one fused launch per layer;
    # the interpreter cannot bind, so every one goes through Triton.
    expected = repeats * (steps - 1) * model.config.n_layer if backend == "triton" else 0
    fused = rows["PagedCache"]  # the default cache: fused decode + write
    assert (fused["bound_launches"], fused["triton_launches"]) == (0, expected)
    assert "bound_launches" not in rows["PagedCache unfused"]  # write + decode
    assert pool.num_used_blocks == 0
    goals = hf_latency.targets(latency)
    assert set(goals["tiny"]) == {"1", "2"} and all(isinstance(g["met"], bool) for g in goals["tiny"].values())
    lines = hf_latency.table_lines(latency, {"tiny": "tiny GPT-2"})
    assert len(lines) == 2 + 2 * 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    verdicts = [line for line in lines[2:] if "| met |" in line or "| **missed** |" in line]
    assert len(verdicts) == 4 and all("PagedCache" in line for line in verdicts)  # two per (model, batch)
