"""`pagedkv bench kernel --smoke` runs end to end on CPU (torch path) and writes its JSON and markdown.

The GPU run happens once, on a lent H200, so the script itself must not be what fails there.
Timings on CPU mean nothing; the test checks the report's structure, never a number.
"""

import json

from pagedkv.bench.kernel import main


def test_smoke_run_writes_every_section(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path: the interpreter would take minutes
    assert main(["--smoke", "--variants", "--no-flex", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernel.json").read_text())
    assert {"decode", "prefill", "write_kv", "steps", "variants", "target_summary"} <= result.keys()
    assert set(result["steps"]) == {"engine_shapes", "chunked_prefill", "mixed_step"}
    assert {"split", "split, in-kernel merge"} == set(result["decode"][0]["schedules"])
    mixed = {row["contender"] for row in result["steps"]["mixed_step"]["rows"]}
    assert any(name.startswith("one launch") for name in mixed) and any(name.startswith("two") for name in mixed)
    assert all(row["met"] in (True, False, None) and row["measured"] for row in result["target_summary"])
    # The split kernel (the engine's prefill call) is a contender wherever prefill is timed.
    assert "split kernel (engine)" in {row["label"] for row in result["prefill_contenders"]}
    assert "split kernel (engine)" in {row["contender"] for row in result["steps"]["chunked_prefill"]["rows"]}
    # No flashinfer in the test environment: the anchor section says so and the run goes on.
    assert result["flashinfer"]["rows"] == [] and "not importable" in result["flashinfer"]["note"]
    markdown = (tmp_path / "kernel.md").read_text()
    for title in ("## Targets", "## Decode", "## Engine shapes", "## Chunked prefill", "## Mixed step", "## Variants",
                  "## pagedkv beside FlashInfer"):
        assert title in markdown
