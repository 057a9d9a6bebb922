"""What every benchmark shares: where results go and the provenance stamped on them."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from pagedkv.errors import PagedKVError


class GPURequiredError(PagedKVError):
    """A benchmark that measures a CUDA GPU was run where torch sees none (one line, exit 2 via `pagedkv.cli`)."""


def require_cuda(command: str, hint: str = "") -> None:
    """Raise `GPURequiredError` naming `command` (and `hint`, what runs on CPU instead) unless CUDA is available."""
    import torch

    if not torch.cuda.is_available():
        raise GPURequiredError(f"{command} needs a CUDA GPU, and torch.cuda.is_available() is False"
                               + (f"; {hint}" if hint else ""))


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
    """Date, commit, host and device of a benchmark run."""
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


def graph_replay_ms(graph, repeats: int = 20) -> float:
    """Median GPU time (ms) of one replay of a captured `torch.cuda.CUDAGraph`, timed with CUDA events."""
    import statistics

    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
