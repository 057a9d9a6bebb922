"""The simulator: deterministic, drives the real scheduler, leaks nothing; the cost model fits; the CLI."""

import json
import random

import pytest

from pagedkv.cli import main
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import ConfigError
from pagedkv.sim import CostModel, Simulation, StepMeasurement, fit, load_cost_model, make_jobs, simulate
from pagedkv.sim.fidelity import load_engine_run, predict
from pagedkv.sim.sweep import naive_config
from pagedkv.sim.workload import split_length

COST = CostModel()
SMALL = ["--jobs", "48", "--clients", "24", "--blocks", "512", "--max-model-len", "1024"]


def small_jobs(num_jobs=60, seed=3):
    """The default mix without its jobs over 1024 tokens, for pools of a few hundred blocks."""
    return [job for job in make_jobs(num_jobs, seed=seed) if job.num_tokens <= 1024]


def test_workload_split_and_distinct_prompts():
    jobs = make_jobs(64, seed=7)
    assert jobs == make_jobs(64, seed=7)
    for job in jobs:
        prompt, output = split_length(job.num_tokens, 0.25)
        assert (job.num_prompt_tokens, job.num_output_tokens) == (prompt, output)
        assert job.num_prompt_tokens >= 1 and job.num_output_tokens >= 1
    first_blocks = {job.prompt_token_ids[:16] for job in jobs if job.num_prompt_tokens >= 16}
    assert len(first_blocks) == sum(1 for job in jobs if job.num_prompt_tokens >= 16)


def test_naive_never_exceeds_32_and_paged_admits_more():
    jobs = make_jobs(160, seed=5)
    base = SchedulerConfig(num_blocks=4096, block_size=16, max_model_len=2048)
    naive = simulate(naive_config(base), jobs, COST, num_clients=64)
    paged = simulate(SchedulerConfig(num_blocks=4096, watermark=0.05), jobs, COST, num_clients=64)
    assert naive.peak_running_seqs == 32  # 4096 blocks / (2048 / 16) blocks reserved each
    assert paged.peak_running_seqs > 32
    assert naive.num_finished == paged.num_finished == 160
    assert naive.num_output_tokens == paged.num_output_tokens == sum(j.num_output_tokens for j in jobs)
    assert paged.throughput_tokens_per_s > naive.throughput_tokens_per_s
    assert paged.mean_decoding_seqs > naive.mean_decoding_seqs


@pytest.mark.parametrize("mode,victim", [("recompute", "requester"), ("recompute", "newest"),
                                         ("recompute", "cheapest"), ("swap", "priority")])
def test_no_blocks_leak_under_preemption(mode, victim):
    jobs = small_jobs()
    cfg = SchedulerConfig(num_blocks=160, block_size=16, max_model_len=1024, watermark=0.0, preemption_mode=mode,
                          victim_policy=victim, num_swap_blocks=64 if mode == "swap" else 0)
    sim = Simulation(cfg, jobs, COST, num_clients=20)
    result = sim.run()
    assert result.num_preemptions > 0, "a tiny pool at 0% watermark should preempt"
    assert result.num_finished == len(jobs)
    sim.scheduler.check_integrity()
    assert sim.scheduler.block_manager.num_used_blocks == 0
    assert sim.scheduler.block_manager.num_free_swap_blocks == cfg.num_swap_blocks


def test_swap_mode_swaps_and_charges_the_copy():
    jobs = small_jobs()
    cfg = SchedulerConfig(num_blocks=160, block_size=16, max_model_len=1024, watermark=0.0,
                          preemption_mode="swap", num_swap_blocks=256)
    result = simulate(cfg, jobs, COST, num_clients=20)
    assert result.num_swap_outs > 0 and result.num_swap_ins == result.num_swap_outs
    assert result.num_swapped_tokens > 0
    free_swap = CostModel(swap_s_per_token=0.0)
    cheaper = simulate(cfg, jobs, free_swap, num_clients=20)
    assert cheaper.sim_time_s < result.sim_time_s


def test_same_seed_same_numbers():
    jobs = small_jobs()
    cfg = SchedulerConfig(num_blocks=160, block_size=16, max_model_len=1024, watermark=0.0)
    assert simulate(cfg, jobs, COST, 20) == simulate(cfg, jobs, COST, 20)


def test_cost_model_fit_recovers_known_constants():
    truth = CostModel(c0_s=3e-3, prefill_s_per_token=15e-6, decode_s_per_seq=40e-6, kv_s_per_token=20e-9)
    rng = random.Random(0)
    steps = []
    for _ in range(200):
        prefill, decode, kv = rng.choice([0, rng.randint(1, 2048)]), rng.randint(0, 128), rng.randint(0, 200_000)
        noise = 1 + rng.uniform(-0.01, 0.01)
        steps.append(StepMeasurement(prefill, decode, kv, truth.step_time_s(prefill, decode, kv) * noise))
    fitted = fit(steps)
    for name in ("c0_s", "prefill_s_per_token", "decode_s_per_seq", "kv_s_per_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name


def test_cost_model_fit_is_non_negative():
    # Time falls with decode_seqs here: plain least squares would give a negative constant.
    steps = [StepMeasurement(0, d, 1000, 0.01 - 1e-5 * d) for d in range(1, 50)]
    fitted = fit(steps)
    assert fitted.decode_s_per_seq == 0.0 and fitted.c0_s > 0


def test_cost_model_file(tmp_path):
    path = tmp_path / "cost_model.json"
    rows = [{"prefill_tokens": p, "decode_seqs": d, "kv_tokens": k, "seconds": COST.step_time_s(p, d, k)}
            for p, d, k in [(0, 8, 1000), (512, 0, 512), (0, 64, 50_000), (1024, 16, 30_000), (0, 1, 10)]]
    path.write_text(json.dumps({"model": "m", "gpu": "g", "measurements": rows}))
    fitted = load_cost_model(path)
    assert fitted.c0_s == pytest.approx(COST.c0_s, rel=1e-6) and "fitted" in fitted.source
    path.write_text(json.dumps({"constants": {"c0_s": 1e-3, "prefill_s_per_token": 1e-5, "decode_s_per_seq": 1e-5,
                                              "kv_s_per_token": 1e-9, "swap_s_per_token": 1e-6}}))
    assert load_cost_model(path).swap_s_per_token == 1e-6
    path.write_text(json.dumps({"model": "m"}))
    with pytest.raises(ConfigError, match="measurements"):
        load_cost_model(path)


def test_fidelity_predicts_an_engine_run(tmp_path, capsys):
    run = {"model": "m", "gpu": "g", "workload": {"prompt_lens": [100, 200, 50] * 8, "output_lens": [64, 32, 128] * 8},
           "engine": {"num_blocks": 256, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 512},
           "measured": {"output_tokens_per_s": 1000.0}}
    path = tmp_path / "engine_run.json"
    path.write_text(json.dumps(run))
    engine_run = load_engine_run(path)
    result = predict(engine_run, COST)
    assert result.sim.num_finished == 24 and result.predicted_tokens_per_s > 0
    assert result.relative_error == pytest.approx(result.predicted_tokens_per_s / 1000.0 - 1)
    assert main(["sim", "--fidelity", str(path), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "measured  1,000.0 tok/s" in out and "relative error" in out
    assert (tmp_path / "sim_fidelity.json").exists()


def test_cli_is_deterministic(tmp_path, capsys):
    args = ["sim", *SMALL, "--watermark", "0.02", "--victim", "cheapest", "--cost-model", str(_default_cost(tmp_path))]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    second = capsys.readouterr().out
    assert first == second
    assert "| naive |" in first and "| paged | recompute | cheapest | 2% |" in first


def test_fp8_kv_doubles_the_blocks_and_halves_the_kv_read_term(tmp_path, capsys):
    base = ["sim", *SMALL, "--json", "--cost-model", str(_default_cost(tmp_path))]
    assert main(base) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main([*base, "--kv-cache-dtype", "fp8_e4m3"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["pool"]["num_blocks"] == 2 * bf16["pool"]["num_blocks"] == 1024
    assert fp8["pool"]["num_swap_blocks"] == 2 * bf16["pool"]["num_swap_blocks"]
    assert fp8["cost_model"]["kv_s_per_token"] == bf16["cost_model"]["kv_s_per_token"] / 2
    assert fp8["cost_model"]["c0_s"] == bf16["cost_model"]["c0_s"]
    paged = [next(r for r in run["rows"] if r["mode"] == "paged") for run in (bf16, fp8)]
    assert paged[1]["throughput_tokens_per_s"] > paged[0]["throughput_tokens_per_s"]
    assert paged[1]["num_preemptions"] <= paged[0]["num_preemptions"]


def test_cli_sweep_writes_json_and_png(tmp_path, capsys):
    args = ["sim", *SMALL, "--sweep", "--victim", "newest", "--workers", "2", "--out", str(tmp_path),
            "--cost-model", str(_default_cost(tmp_path))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Throughput relative to naive" in out
    payload = json.loads((tmp_path / "sim_sweep.json").read_text())
    rows = payload["rows"]
    assert rows[0]["mode"] == "naive" and rows[0]["throughput_vs_naive"] == 1.0
    assert {(r["preemption"], r["watermark"]) for r in rows[1:]} == {
        (mode, w) for mode in ("recompute", "swap") for w in (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)}
    assert "commit" in payload["provenance"]
    assert (tmp_path / "sim_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bad,needle", [
    (["--blocks", "0"], "--blocks"),
    (["--kv-cache-dtype", "fp4"], "kv_cache_dtype 'fp4'"),
    (["--clients", "-3"], "--clients"),
    (["--victim", "oldest"], "--victim"),
    (["--preemption", "drop"], "--preemption"),
    (["--watermark", "1.0"], "--watermark"),
    (["--watermark", "-0.1"], "--watermark"),
    (["--jobs", "many"], "--jobs"),
    (["--no-such-flag"], "unrecognized"),
    (["--model", "llama3-8b"], "no sliding-window layers"),
    (["--model", "gemma3-1b", "--sweep"], "--model applies only"),
])
def test_bad_input_is_one_line_exit_2(bad, needle, capsys):
    assert main(["sim", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv: error: ") and needle in err and err.count("\n") == 1


def _default_cost(tmp_path):
    """A cost-model file with the default constants, so the tests do not depend on the committed calibration."""
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"constants": COST.constants()}))
    return path


def test_model_with_sliding_layers_adds_a_grouped_run_in_the_same_memory(tmp_path, capsys):
    """Gemma 3 1B (window 512): blocks of 4 of its 26 layers, so the same memory holds 26/4 the blocks, and
    sliding groups keep only their window: more sequences decode at once than with full-length tables."""
    args = ["--jobs", "48", "--clients", "24", "--blocks", "256", "--max-model-len", "2048"]
    assert main(["sim", *args, "--json", "--model", "gemma3-1b", "--cost-model", str(_default_cost(tmp_path))]) == 0
    rows = {row["mode"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"naive", "paged", "paged per group"}
    assert rows["paged per group"]["mean_decoding_seqs"] > rows["paged"]["mean_decoding_seqs"]
    assert rows["paged per group"]["num_preemptions"] < rows["paged"]["num_preemptions"]
