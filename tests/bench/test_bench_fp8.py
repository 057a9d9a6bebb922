"""The FP8 sections of the GPU benchmarks run end to end on CPU (torch path); numbers mean nothing here.

`pagedkv bench kernel --kv-dtype fp8_e4m3` and `pagedkv bench engine --preset kv-bound` run once,
on a lent H200, so the scripts themselves must not be what fails there.
"""

import json

import pytest

from pagedkv.bench.engine_kv_bound import kv_bound_workload
from pagedkv.bench.engine_timing import decode_share
from pagedkv.bench.kernel import main as kernel_main
from pagedkv.cli import main


def test_kernel_bench_fp8_section(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path: the interpreter would take minutes
    assert kernel_main(["--smoke", "--kv-dtype", "fp8_e4m3", "--fp8-only", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernel_fp8.json").read_text())
    rows = result["fp8_decode"]
    assert [row["schedule"] for row in rows] == ["split", "tiles (FP8 default)", "split, in-kernel merge"]
    split = rows[0]
    for row in rows:
        assert row["model_default_ms"] == split["model_ms"]  # every ratio is against the model dtype's default
        assert row["ok"] and row["max_abs_err"] < 1e-3  # validated against the reference before timing
        assert row["fp8_kv_bytes"] * 4 == row["model_kv_bytes"]  # fp32 smoke caches: 4 bytes against 1
        assert row["time_ratio"] is not None and row["targets"]
    assert all(t["target"].startswith("fp8 decode") for t in result["target_summary"])


def test_kv_bound_workload_is_decode_dominated():
    prompts, outputs = kv_bound_workload(50, seed=0, vocab=128256)
    assert (prompts, outputs) == kv_bound_workload(50, seed=0, vocab=128256)
    assert all(1000 <= len(p) <= 2000 for p in prompts) and all(1000 <= n <= 3000 for n in outputs)
    assert sum(outputs) > sum(len(p) for p in prompts)  # more tokens decoded than prefilled


def test_decode_share_counts_the_steps_without_prefill():
    steps = [{"prefill_tokens": 512, "seconds": 0.3}, {"prefill_tokens": 0, "seconds": 0.5},
             {"prefill_tokens": 0, "seconds": 0.2}]
    assert decode_share(steps) == pytest.approx(0.7)
    assert decode_share([]) == 0.0


@pytest.mark.parametrize("argv", [["bench", "engine", "--preset", "kv-bound", "--kv-cache-dtype", "fp4"],
                                  ["bench", "kernel", "--kv-dtype", "int8"]])
def test_bad_kv_dtype_is_one_line_exit_2(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1
