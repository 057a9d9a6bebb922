"""The user's path (issue 23): documented commands run as written, answer the same from any
directory, write only where the user points, and fail fast with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import main

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m pagedkv ARGS` in `cwd`, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "pagedkv", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------------- 1. calc
def test_calc_budget_without_mean_len_uses_a_stated_default(capsys):
    assert main(["calc", "--model", "llama3-70b", "--budget-gb", "80", "--kv-dtype", "fp8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    budget = result["budget"]
    assert budget["mean_len"] <= budget["max_len"]
    assert any(f"{budget['mean_len']:,}" in note and "--mean-len" in note for note in result["notes"])


def test_calc_kv_dtype_note_names_the_flag_given(capsys):
    assert main(["calc", "--model", "llama3-70b", "--kv-dtype", "fp8", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert not any("given explicitly" in note for note in notes)
    assert any(note.startswith("--kv-dtype fp8 gives 1 B") for note in notes)
    assert main(["calc", "--model", "llama3-70b", "--dtype-bytes", "4", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(note.startswith("--dtype-bytes 4 gives 4 B") for note in notes)


# ---------------------------------------------------------------------- 2. answers do not depend on the directory
SIM_SMALL = ["--jobs", "48", "--clients", "16"]


@pytest.mark.parametrize("args", [
    ["sim", *SIM_SMALL],
    ["sim", "--sweep", "--quick", "--workers", "1"],
    ["calc", "--model", "llama3-70b", "--budget-gb", "80", "--kv-dtype", "fp8"],
], ids=["sim", "sim-sweep-quick", "calc"])
def test_output_is_the_same_from_any_directory(args, tmp_path):
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runs = [run_cli(*args, "--out", str(out), cwd=cwd) if args[0] == "sim" else run_cli(*args, cwd=cwd)
            for cwd in (REPO, elsewhere)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    assert runs[0].stdout == runs[1].stdout
    if args[0] == "sim":
        assert runs[0].stdout.startswith("cost model: packaged cost_model_h200.json")


def test_the_packaged_cost_model_is_package_data():
    import tomllib
    from fnmatch import fnmatch

    from pagedkv.sim.cost_model import PACKAGED_COST_MODEL, packaged_cost_model

    assert packaged_cost_model().source.startswith("packaged ")
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch(f"data/{PACKAGED_COST_MODEL}", glob) for glob in package_data["pagedkv.sim"])


# ---------------------------------------------------------------------- 3. commands write where the user points
def test_default_output_goes_outside_the_working_directory(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    env = {"HOME": str(home), "PAGEDKV_OUT": ""}
    result = run_cli("bench", "allocator", "--pairs", "2000", cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    written = home / ".cache" / "pagedkv" / "results" / "allocator.json"
    assert written.is_file() and str(written) in result.stdout
    assert list(cwd.iterdir()) == []
    result = run_cli("sim", "--sweep", "--quick", "--workers", "1", cwd=cwd, env={**env, "PAGEDKV_OUT": str(tmp_path / "o")})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "o" / "sim_sweep.json").is_file() and str(tmp_path / "o") in result.stdout
    assert list(cwd.iterdir()) == []


def test_no_command_defaults_to_a_path_in_the_source_tree():
    offenders = [f"{path.relative_to(REPO)}:{number}"
                 for path in sorted((REPO / "src" / "pagedkv").rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if "add_argument" in line and 'default="benchmarks' in line]
    assert offenders == []


# ---------------------------------------------------------------------- 11. the same condition, the same exit
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("name", ["kernel", "engine", "latency", "hf"])
def test_gpu_benchmarks_without_a_gpu_exit_2_with_one_line(name, capsys, tmp_path):
    assert main(["bench", name, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"pagedkv: error: pagedkv bench {name} needs a CUDA GPU, and ")


# ---------------------------------------------------------------------- 4. sim --cluster: a small default, progress
def test_cluster_defaults_simulate_a_small_workload():
    from pagedkv.sim.chat_workload import ARRIVAL_PROCESSES
    from pagedkv.sim.cli import build_parser
    from pagedkv.sim.cluster_cli import _choices, _workload

    args = build_parser().parse_args(["--cluster"])
    arrivals = _choices(args.arrival, ARRIVAL_PROCESSES, "--arrival", "both")
    # The sizing searches simulate each workload a few times over: keep the default to ~1,000 requests.
    assert sum(_workload(args, arrival).num_requests for arrival in arrivals) <= 1000


def test_cluster_shows_progress_and_what_the_search_does(tmp_path):
    small = ["--rate", "40", "--requests", "120", "--replicas", "2", "--system-prompts", "4", "--system-prompt-len",
             "64", "--user-tokens", "4,24", "--output-tokens", "4,24", "--replica-blocks", "256", "--max-model-len",
             "256", "--max-replicas", "4", "--policy", "prefix", "--workers", "1"]
    result = run_cli("sim", "--cluster", *small, "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "replica-count searches (double from 1 replica until a run meets P99 TTFT" in result.stderr
    assert "sizing poisson/prefix: " in result.stderr and "(tried 1" in result.stderr
    assert "simulations: 100%" in result.stderr
    assert "simulations" not in result.stdout


# ---------------------------------------------------------------------- 5. generate with a random: model
def test_random_model_text_prompt_is_refused_before_the_model_loads(monkeypatch, capsys):
    import pagedkv.engine.llm

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded before the prompts were checked")

    monkeypatch.setattr(pagedkv.engine.llm, "LLM", must_not_load)
    assert main(["generate", "--model", "random:tiny-llama", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "random:tiny-llama" in err and "--token-ids" in err
    assert main(["generate", "--model", "random:no-such-shape", "--token-ids", "1 2"]) == 2
    assert "no-such-shape" in capsys.readouterr().err


def test_random_model_generates_from_token_ids_and_labels_each_completion(capsys):
    args = ["generate", "--model", "random:tiny-llama", "--device", "cpu", "--token-ids", "1,2,3", "--max-tokens",
            "4", "--n", "2", "--temperature", "1", "--seed", "3", "--ignore-eos"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "### 1,2,3"
    assert lines[1] == "--- completion 1 of 2" and lines[4] == "--- completion 2 of 2"
    for body in (lines[2], lines[5]):
        assert len(body.split()) == 4 and all(token.isdigit() for token in body.split())


# ---------------------------------------------------------------------- 6. an unreachable hub fails fast
@pytest.mark.parametrize("env", [{"HF_ENDPOINT": "http://127.0.0.1:9"}, {"HF_HUB_OFFLINE": "1"}],
                         ids=["unreachable", "offline"])
def test_unknown_hub_id_without_network_is_one_line(env, tmp_path):
    env = {**env, "HF_HOME": str(tmp_path / "hf"), "HTTPS_PROXY": "", "https_proxy": "", "ALL_PROXY": "",
           "all_proxy": ""}
    result = run_cli("generate", "--model", "no-such-org/no-such-model", "hi", cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "'no-such-org/no-such-model'" in result.stderr
    assert ("HF_HUB_OFFLINE" in result.stderr) == ("HF_HUB_OFFLINE" in env)


# ---------------------------------------------------------------------- 7 and 9. the tokenizer loader
def test_the_embedded_tokenizer_pads_a_batch():
    from pagedkv.hf import load_tokenizer

    tokenizer = load_tokenizer(None)
    assert tokenizer.pad_token is not None
    batch = tokenizer(["Hi", "The capital of France is"], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()


def test_the_tokenizer_loads_and_decodes_without_warnings(tmp_path):
    code = ("from pagedkv.hf import load_tokenizer\n"
            "tokenizer = load_tokenizer(None)\n"
            "print(tokenizer.decode(tokenizer('Hello , world !')['input_ids']))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Hello , world !\n"
    assert "clean_up_tokenization_spaces" not in result.stderr


def test_make_demo_says_what_the_install_does():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "@echo" in recipe.split("$(PIP)", 1)[0]


# ---------------------------------------------------------------------- 10. server answers as OpenAI does
@pytest.fixture(scope="module")
def tiny_server():
    from helpers import tiny
    from server_helpers import LiveServer

    from pagedkv import LLM
    from pagedkv.server import create_app

    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=128)
    with LiveServer(create_app(llm.engine, "tiny")) as server:
        yield server


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models/gpt-5", None),
    ("POST", "/v1/completions", {"model": "gpt-5", "prompt": [5, 6], "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}),
], ids=["models-by-id", "completions", "chat"])
def test_an_unknown_model_is_404_model_not_found_everywhere(tiny_server, method, path, body):
    import httpx

    response = httpx.request(method, f"{tiny_server.url}{path}", json=body, timeout=30)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found" and "'gpt-5'" in response.json()["error"]["message"]


def test_too_many_max_tokens_names_max_tokens_and_a_too_long_prompt_names_prompt(tiny_server):
    import httpx

    max_model_len = tiny_server.on_engine(lambda engine: engine.max_model_len)
    url = f"{tiny_server.url}/v1/completions"
    response = httpx.post(url, json={"prompt": [5, 6, 7], "max_tokens": max_model_len}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens", response.text
    response = httpx.post(url, json={"prompt": [5] * (max_model_len + 1), "max_tokens": 1}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text


def test_a_form_encoded_body_is_told_the_content_type(tiny_server):
    import httpx

    response = httpx.post(f"{tiny_server.url}/v1/completions", data={"prompt": "hi"}, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "Content-Type: application/json" in message and "application/x-www-form-urlencoded" in message


# ---------------------------------------------------------------------- the checkout guard (conftest)
def test_the_checkout_guard_sees_rewritten_results_and_new_files(tmp_path, monkeypatch):
    import conftest

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "sim_sweep.json").write_text("{}")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results")
    monkeypatch.setattr(conftest, "REPO_ROOT", tmp_path)
    clean = conftest._tree_snapshot()
    assert clean == {}
    (tmp_path / "new_module.py").write_text("")  # work in progress elsewhere: not a command's output
    assert conftest._tree_snapshot() == clean
    (tmp_path / "benchmarks" / "results" / "sim_sweep.json").write_text('{"rewritten": 1}')
    rewritten = conftest._tree_snapshot()
    assert list(rewritten) == ["benchmarks/results/sim_sweep.json"]
    (tmp_path / "benchmarks" / "results" / "sim_sweep.json").write_text('{"rewritten": 2}')
    assert conftest._tree_snapshot() != rewritten  # the same status line, other content
    (tmp_path / "allocator.json").write_text("{}")
    assert "allocator.json" in conftest._tree_snapshot()
