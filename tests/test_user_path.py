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
