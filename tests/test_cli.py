"""The CLI: subcommands run, bad input is one line and exit status 2."""

import json

from pagedkv.cli import main


def test_memory_demo_runs(capsys):
    assert main(["demo", "--memory", "--seqs", "8"]) == 0
    out = capsys.readouterr().out
    assert "naive" in out and "paged" in out and "0 blocks in use" in out


def test_bench_allocator_writes_json(tmp_path, capsys):
    assert main(["bench", "allocator", "--pairs", "2000", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "allocator.json").read_text())
    assert [row["num_blocks"] for row in result["rows"]] == [1024, 1048576]
    assert all(row["single_pairs_per_s"] > 0 for row in result["rows"])
    assert "commit" in result["provenance"]


def test_bad_input_is_one_line_exit_2(capsys):
    assert main(["demo", "--memory", "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv: error: ") and "block_size" in err and err.count("\n") == 1
