"""Where command results go and what they record: the `--out` directory, JSON files and their provenance.

Benchmarks and the simulator both write results through this module, so neither has to
import the other.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path


def git_commit() -> str:
    """The checkout's HEAD commit (with '-dirty' when it has changes), or 'unknown'."""
    try:
        here = Path(__file__).resolve().parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True,
            timeout=5,
        ).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) or os.environ.get("PAGEDKV_COMMIT", "unknown")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("PAGEDKV_COMMIT", "unknown")


def provenance(device: str | None = None) -> dict:
    """Date, commit, host and device of a run (a benchmark's or a simulation's)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": os.environ.get("PAGEDKV_COMMIT") or git_commit(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "device": device or "cpu",
    }


def default_out_dir() -> Path:
    """Where results go when no --out is given: `$PAGEDKV_OUT`, else ~/.cache/pagedkv/results.

    NOTE: never a path relative to the working directory: run from a checkout, that would
    overwrite the committed results the README describes.
    """
    return Path(os.environ.get("PAGEDKV_OUT") or Path.home() / ".cache" / "pagedkv" / "results")


def add_out_argument(parser, files: str) -> None:
    """The `--out DIR` flag of a command that writes `files`, defaulting to `default_out_dir()`."""
    parser.add_argument("--out", metavar="DIR", default=str(default_out_dir()),
                        help=f"directory for {files} (default: $PAGEDKV_OUT, else ~/.cache/pagedkv/results)")


def write_json(out_dir: str | os.PathLike, name: str, payload: dict) -> Path:
    """Write `payload` as `<out_dir>/<name>.json` and return the path."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{name}.json"
    target.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return target
