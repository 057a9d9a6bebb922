"""The tiles decode schedule (`triton_decode_tiles`) against the float64 reference, and its split plan.

On CPU the kernel runs under the interpreter on NaN-poisoned pools (`kernel_scenarios`): every
table mode (inline, gather, select), packed kv heads (1, 2, 4, narrowed to a power-of-2
divisor of the kv heads), both merges, read-ahead chunks smaller than a split (several outer
steps, page-aligned or not), windows, soft caps, empty rows and strided views. The interpreter has 4
"SMs" (`tuning.num_sms`), so `programs_per_sm` decides whether a small batch splits; each
split test asserts that it did. A compile test (subprocess, sm_90 through ptxas) checks the
point of the read-ahead: a pipelined K/V buffer per stage, where the inline table load keeps
one. GPU tests at full size carry the gpu marker.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_scenarios import (
    LENGTHS,
    GpuScenario,
    Scenario,
    assert_gpu_matches,
    assert_matches,
    interleave,
    poisoned_views,
    strided_out,
)

from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import DecodeTuning, KernelWorkspace, paged_decode_attention, reference_decode_attention
from pagedkv.kernels.tuning import tiles_plan

DTYPES = [torch.float32, torch.float16]
HEAD_SIZES = [64, 80, 128]
BLOCK_SIZES = [8, 16, 32]
NUM_HEADS = [(4, 4), (8, 2), (6, 3), (8, 4)]  # (q heads, kv heads): GQA ratios 1, 4, 2, 2
TABLES = ["inline", "gather", "select"]

#: dtype, (q heads, kv heads), head_dim, block_size, table mode: together every value above.
CASES = [
    (torch.float32, (4, 4), 64, 16, "gather"),
    (torch.float16, (8, 2), 128, 8, "select"),
    (torch.float32, (6, 3), 80, 32, "inline"),
    (torch.float16, (8, 4), 64, 16, "gather"),
]
CASE_IDS = [f"{str(d)[6:]}-h{h}:{kv}-d{hd}-bs{bs}-{t}" for d, (h, kv), hd, bs, t in CASES]
SCALE = 0.125


def tiles(**options) -> DecodeTuning:
    """A tiles tuning with interpreter-sized tiles: 16 tokens per tile, splits from 16 tokens up."""
    options = {"block_n": 16, "min_split_tokens": 16, **options}
    return DecodeTuning(schedule="tiles", **options)


def run(scenario, num_q_heads, tuning, *, workspace=None, query_gain=1.0, **options):
    query = scenario.query(len(scenario.seq_lens), num_q_heads) * query_gain
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_decode_attention(*args, scale=SCALE, **options, float64=True)
    out = paged_decode_attention(*args, scale=SCALE, max_seq_len=int(scenario.seq_lens.max()), backend="triton",
                                 tuning=tuning, workspace=workspace, **options)
    return out, expected


def plan_splits(scenario, num_q_heads, tuning, sliding_window=None) -> int:
    from pagedkv.kernels.triton_decode_tiles import tiles_launch_config

    num_blocks, block_size, num_kv_heads, head_dim = scenario.k_cache.shape
    config = tiles_launch_config(len(scenario.seq_lens), num_q_heads, head_dim, block_size, num_kv_heads,
                                 int(scenario.seq_lens.max()), sliding_window, 4, tuning)
    return config["num_splits"]


# --------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("merge", ["in_kernel", "launch"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tiles_split_matches_reference(case, merge):
    dtype, (num_q_heads, num_kv_heads), head_dim, block_size, table = case
    # 1, one more than a page, empty, and a long one that splits into several pieces
    scenario = Scenario([1, block_size + 1, 0, 5 * block_size + 3], block_size, num_kv_heads, head_dim, dtype, seed=1)
    tuning = tiles(table=table, merge=merge, programs_per_sm=16)
    assert plan_splits(scenario, num_q_heads, tuning) > 1
    workspace = KernelWorkspace(len(scenario.seq_lens) * num_kv_heads, "cpu")
    for _ in range(2 if merge == "in_kernel" else 1):  # a second call starts from the counters the first left
        out, expected = run(scenario, num_q_heads, tuning, workspace=workspace)
        assert_matches(out, expected, dtype)
        assert torch.equal(out[2], torch.zeros_like(out[2])), "a zero-length row must come out as zeros"
        workspace.check_integrity()


@pytest.mark.parametrize("table", TABLES)
def test_tiles_unsplit_matches_reference(table):
    """One program per (sequence, kv head): the batch already fills the interpreter's slots."""
    scenario = Scenario([1, 16, 17, 37, 48, 0, 3, 30], 16, 2, 64, torch.float32, seed=2)
    tuning = tiles(table=table, programs_per_sm=1)
    assert plan_splits(scenario, 8, tuning) == 1
    out, expected = run(scenario, 8, tuning)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("heads_per_program, num_heads, packed", [
    (2, (8, 4), 2), (4, (8, 4), 4), (4, (4, 4), 4), (4, (6, 3), 1), (8, (12, 6), 2),
], ids=["2-of-4-group2", "4-of-4-group2", "4-of-4-mha", "4-narrowed-to-1-of-3", "8-narrowed-to-2-of-6"])
@pytest.mark.parametrize("programs_per_sm", [1, 32], ids=["unsplit", "split"])
def test_tiles_packed_heads(heads_per_program, num_heads, packed, programs_per_sm):
    """Several kv heads per program: each q row sees only its own head's keys (the rest is masked).

    The packing narrows to a power-of-2 divisor of the kv heads (a tile is BLOCK_N x heads rows).
    """
    from pagedkv.kernels.triton_decode_tiles import tiles_launch_config

    num_q_heads, num_kv_heads = num_heads
    scenario = Scenario([1, 17, 40, 9, 33], 16, num_kv_heads, 64, torch.float16, seed=3)
    tuning = tiles(heads_per_program=heads_per_program, programs_per_sm=programs_per_sm, table="gather",
                   merge="in_kernel")
    assert tiles_launch_config(5, num_q_heads, 64, 16, num_kv_heads, 40, None, 4, tuning)["HEADS"] == packed
    out, expected = run(scenario, num_q_heads, tuning)
    assert_matches(out, expected, torch.float16)


@pytest.mark.parametrize("block_size, block_n, table_chunk", [(8, 16, 2), (32, 16, 2), (16, 32, 4)],
                         ids=["aligned-2-pages", "tile-smaller-than-page", "aligned-4-pages"])
@pytest.mark.parametrize("table", ["gather", "select"])
def test_tiles_read_ahead_in_several_chunks(block_size, block_n, table_chunk, table):
    """A table chunk far shorter than a split: several outer steps, each reading the next chunk ahead."""
    scenario = Scenario([3 * block_size + 5, 150, 7], block_size, 2, 64, torch.float32, seed=4)
    tuning = tiles(block_n=block_n, table=table, table_chunk=table_chunk, programs_per_sm=2)
    out, expected = run(scenario, 4, tuning)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("sliding_window, soft_cap", [(6, None), (None, 3.0), (20, 2.0), (1, None)])
@pytest.mark.parametrize("table", TABLES)
def test_tiles_window_and_soft_cap(table, sliding_window, soft_cap):
    scenario = Scenario([1, 17, 40, 9, 70], 8, 2, 64, torch.float32, seed=5)
    tuning = tiles(table=table, programs_per_sm=32, table_chunk=4, heads_per_program=2)
    out, expected = run(scenario, 6, tuning, query_gain=3.0, sliding_window=sliding_window, soft_cap=soft_cap)
    assert_matches(out, expected, torch.float32)


def test_tiles_reads_strided_views():
    """block_tables[:, ::2], seq_lens[::2], a query and an out with head_dim stride 2."""
    scenario = Scenario([1, 17, 40, 9], 8, 2, 64, torch.float32, seed=6)
    tables, lens = poisoned_views(scenario)
    query = interleave(scenario.query(4, 8), float("nan"), dim=2)
    out = strided_out(query)
    expected = reference_decode_attention(query.contiguous(), scenario.k_cache, scenario.v_cache,
                                          scenario.block_tables, scenario.seq_lens, scale=SCALE, float64=True)
    for tuning in (tiles(programs_per_sm=32, merge="in_kernel"), tiles(programs_per_sm=32, merge="launch"),
                   tiles(programs_per_sm=1, table="select")):
        paged_decode_attention(query, scenario.k_cache, scenario.v_cache, tables, lens, scale=SCALE, max_seq_len=40,
                               out=out, backend="triton", tuning=tuning)
        assert_matches(out, expected, torch.float32)
        assert out._base[..., 1::2].isnan().all(), "wrote between the strided out's elements"


# --------------------------------------------------------------------------- plan and tuning
@pytest.mark.parametrize("num_items, span, sm_count, per_sm, expected", [
    (8, 32768, 132, 4, (64, 512)),  # 528 slots / 8 items = 66 splits of 497 -> 512 tokens -> 64 splits
    (8, 32768, 132, 3, (47, 704)),  # 49 splits of 669 -> 704 tokens (11 tiles) -> 47 splits
    (512, 512, 132, 4, (1, 512)),  # the batch fills the slots: no split
    (512, 512, 132, 8, (2, 256)),
    (64, 4096, 132, 2, (4, 1024)),
    (1, 100, 132, 4, (1, 128)),  # min_split_tokens (256) caps the splits; one tile-rounded split
])
def test_tiles_plan_rounds_down_to_one_wave(num_items, span, sm_count, per_sm, expected):
    tuning = DecodeTuning(schedule="tiles", programs_per_sm=per_sm)
    num_splits, split_tokens = tiles_plan(num_items, span, 64, sm_count, tuning)
    assert (num_splits, split_tokens) == expected
    assert num_items * num_splits <= max(num_items, per_sm * sm_count)  # never a second wave it did not need
    assert num_splits * split_tokens >= span > (num_splits - 1) * split_tokens  # covers the span, none empty
    assert split_tokens % 64 == 0


@pytest.mark.parametrize("options", [{"table": "preload"}, {"table_chunk": 48}, {"table_chunk": 1},
                                     {"tiles_max_waves": 0}, {"heads_per_program": 0}, {"schedule": "tile"}])
def test_tiles_tuning_rejects_bad_values(options):
    with pytest.raises(InvalidArgumentError):
        DecodeTuning(**options)


# --------------------------------------------------------------------------- sm_90 compile
_COMPILE_SCRIPT = """
import json, torch
from pagedkv.kernels import DecodeTuning, paged_decode_attention
from pagedkv.kernels.offline_compile import compile_only
k = torch.zeros(256, 16, 8, 128, dtype=torch.bfloat16)
table = torch.arange(256, dtype=torch.int32).view(1, -1)
rows = {}
with compile_only() as launched:
    for table_mode in ("inline", "gather", "select"):
        launched.clear()
        paged_decode_attention(torch.zeros(1, 32, 128, dtype=torch.bfloat16), k, k.clone(), table,
                               torch.full((1,), 4096, dtype=torch.int32), scale=0.1, max_seq_len=4096,
                               validate=False, backend="triton",
                               tuning=DecodeTuning(schedule="tiles", table=table_mode, merge="in_kernel"))
        rows[table_mode] = launched[0][1].metadata.shared
print(json.dumps(rows))
"""


def test_read_ahead_table_pipelines_kv_deeper_on_sm90():
    """Compiled for sm_90 (3 stages, 64-token tiles of K and V = 32 KiB): inline keeps one buffer, read-ahead two."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    shared = json.loads(result.stdout.splitlines()[-1])
    tile_bytes = 2 * 64 * 128 * 2
    assert tile_bytes <= shared["inline"] < 2 * tile_bytes
    assert shared["gather"] >= 2 * tile_bytes and shared["select"] >= 2 * tile_bytes


# --------------------------------------------------------------------------- GPU, full size
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tuning", [
    DecodeTuning(schedule="tiles"), DecodeTuning(schedule="tiles", merge="in_kernel", programs_per_sm=3),
    DecodeTuning(schedule="tiles", table="select", block_n=32, num_warps=2),
    DecodeTuning(schedule="tiles", table="inline", num_stages=5),
    DecodeTuning(schedule="tiles", heads_per_program=4, block_n=16, merge="in_kernel"),
], ids=["default", "in-kernel-3", "select-n32-w2", "inline-s5", "heads4"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 8, 128), (9, 3, 64), (12, 12, 64)],
                         ids=["llama3", "qwen3", "smollm2", "gpt2"])
def test_tiles_gpu_matches_reference(heads, tuning):
    num_heads, num_kv_heads, head_dim = heads
    scenario = GpuScenario(LENGTHS + [0, 32768], 16, num_kv_heads, head_dim, torch.bfloat16, seed=40)
    query = scenario.query(len(LENGTHS) + 2, num_heads)
    workspace = KernelWorkspace((len(LENGTHS) + 2) * num_kv_heads, "cuda")
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    for _ in range(2):
        out = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=32768, tuning=tuning,
                                     workspace=workspace)
        assert_gpu_matches(out, expected, torch.bfloat16)
        workspace.check_integrity()


# --------------------------------------------------------------------------- the sweep script
def _load_sweep():
    import importlib.util
    from pathlib import Path

    root = next(p for p in Path(__file__).resolve().parents if (p / "benchmarks").is_dir())
    path = root / "benchmarks" / "tools" / "decode_sweep.py"
    spec = importlib.util.spec_from_file_location("decode_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_sweep_smoke_runs_end_to_end(tmp_path):
    """benchmarks/tools/decode_sweep.py --smoke: every contender checked and timed, JSON and markdown written."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the smoke run uses the Triton interpreter")
    sweep = _load_sweep()
    assert sweep.main(["--smoke", "--workers", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "decode_sweep.json").read_text())
    assert len(result["cases"]) == 2 and (tmp_path / "decode_sweep.md").exists()
    for case in result["cases"]:
        for name in ("production", "sdpa", "copy"):
            assert case["baselines"][name].get("rotated_ms"), (name, case["baselines"][name])
        assert case["configs"] and all(r["ok"] and r["rotated_ms"] > 0 for r in case["configs"]), case["configs"]
        assert case["best"]["label"] in {r["label"] for r in case["configs"]}
    assert any(r["num_splits"] > 1 for r in result["cases"][0]["configs"]), "the smoke run must exercise a split"


def test_decode_sweep_compile_group_runs_every_launch():
    """The compile-ahead worker runs each (case, tuning) launch once on a tiny pool, errors collected, not raised."""
    sweep = _load_sweep()
    args = type("Args", (), {"quick": False, "smoke": True, "cases": ""})()
    cases, launches = sweep.build_plan(args)
    groups = sweep.compile_groups(launches, "cpu")
    assert sum(len(g["launches"]) for g in groups) == len(launches)
    assert {tuple(g["heads"]) for g in groups} == {tuple(c[1]) for c in cases}
    assert sweep._compile_group(groups[0]) == []
    broken = {**groups[0], "launches": [(1, 64, {"schedule": "tiles", "table": "bogus"})]}
    assert len(sweep._compile_group(broken)) == 1


@pytest.mark.parametrize("tiles_max_waves, runs_tiles", [(None, True), (8.0, True), (0.5, False)])
def test_tiles_max_waves_hands_big_batches_to_the_split_kernel(monkeypatch, tiles_max_waves, runs_tiles):
    """5 sequences x 2 kv heads = 10 items on the interpreter's 4 SMs: 2.5 waves."""
    import pagedkv.kernels.triton_decode_tiles as tiles_module

    calls = []
    original = tiles_module.triton_tiles_decode
    monkeypatch.setattr(tiles_module, "triton_tiles_decode", lambda *a, **k: calls.append(1) or original(*a, **k))
    scenario = Scenario([1, 17, 40, 9, 33], 16, 2, 64, torch.float32, seed=7)
    out, expected = run(scenario, 8, tiles(tiles_max_waves=tiles_max_waves))
    assert_matches(out, expected, torch.float32)
    assert bool(calls) == runs_tiles


@pytest.mark.parametrize("value, expected", [(None, "split tiles"), ("tiles", "tiles tiles"),
                                             ("split", "split split"),
                                             ("bogus", "PAGEDKV_DECODE_SCHEDULE must be one of")])
def test_decode_schedule_environment_picks_the_default_launch(value, expected):
    """Calls without a `tuning` (the engine's) run split over model-dtype caches and tiles over FP8 ones;
    PAGEDKV_DECODE_SCHEDULE sets one schedule for both, and a bad name fails on import, naming itself. The
    fused write+decode kernel keeps the split schedule either way."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_DECODE_SCHEDULE"}
    if value is not None:
        env["PAGEDKV_DECODE_SCHEDULE"] = value
    code = ("import pagedkv.kernels.ops as o; "
            "print(o._DEFAULT_DECODE.schedule, o._DEFAULT_FP8_DECODE.schedule, o._SPLIT_DECODE.schedule)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if value == "bogus":
        assert proc.returncode != 0 and expected in proc.stderr and "'bogus'" in proc.stderr
        assert "ConfigError" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == expected.split() + ["split"]


def test_tiles_default_takes_engine_shaped_calls(monkeypatch):
    """With the tiles default, a call shaped like the engine backend's (a split count given, no tuning) runs the
    tiles kernel, which plans its own splits, and matches."""
    import pagedkv.kernels.ops as ops
    import pagedkv.kernels.triton_decode_tiles as tiles_module

    calls = []
    original = tiles_module.triton_tiles_decode
    monkeypatch.setattr(tiles_module, "triton_tiles_decode", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(ops, "_DEFAULT_DECODE", DecodeTuning(schedule="tiles"))
    scenario = Scenario([1, 17, 40], 16, 2, 64, torch.float32, seed=3)
    query = scenario.query(3, 8)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    out = paged_decode_attention(*args, scale=SCALE, max_seq_len=40, num_splits=3, backend="triton")
    assert_matches(out, reference_decode_attention(*args, scale=SCALE, float64=True), torch.float32)
    assert calls
