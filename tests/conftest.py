"""Shared pytest setup: run Triton kernels under the interpreter when there is no CUDA.

TRITON_INTERPRET must be in the environment before Triton is first imported (the decorator
decides at import time whether a kernel compiles or interprets), so it is set here, before
any test module is collected. Importing torch does not import Triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_loop_bounds() -> None:
    """Let the interpreter take a runtime loop bound under NumPy >= 2.4 (triton-lang/triton#9171).

    The interpreter holds scalars as 1-element arrays and turns a `range(lo, hi)` bound into an
    int with `int(array)`, which NumPy 2.4 refuses for ndim > 0. Triton <= 3.6 has no fix yet,
    so the tensor's `__index__` is re-patched to read the one element explicitly.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagedkv_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedkv_fixed = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_loop_bounds()


def pytest_collection_modifyitems(config, items):
    """Skip the `gpu`-marked tests where there is no CUDA GPU: they sit beside the CPU tests they mirror."""
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# ---------------------------------------------------------------------- the checkout stays as it was
import hashlib  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Where a command that writes into the tree would leave files: committed results, and any new
#: non-source file (source files are left out: other work in progress adds them).
RESULTS_DIR = "benchmarks/results/"
SOURCE_SUFFIXES = (".py",)


def _tree_snapshot() -> dict[str, tuple[str, str]] | None:
    """`git status --porcelain` of the paths a command could write, with each such file's hash; None outside git."""
    try:
        status = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=all"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if status.returncode != 0:
        return None
    snapshot = {}
    for entry in status.stdout.split("\0"):
        code, path = entry[:2], entry[3:]
        if not path or not (path.startswith(RESULTS_DIR) or (code == "??" and not path.endswith(SOURCE_SUFFIXES))):
            continue
        file = REPO_ROOT / path
        digest = hashlib.sha1(file.read_bytes()).hexdigest() if file.is_file() else "-"
        snapshot[path] = (code, digest)
    return snapshot


@pytest.fixture(scope="session", autouse=True)
def checkout_is_unchanged():
    """Fail the session if it changed a committed result or left a new non-source file in the checkout.

    Commands write to --out or $PAGEDKV_OUT, never into the source tree (issue 23). Set
    PAGEDKV_SKIP_TREE_CHECK=1 while other work edits the same checkout during the run.
    """
    before = None if os.environ.get("PAGEDKV_SKIP_TREE_CHECK") else _tree_snapshot()
    yield
    if before is None:
        return
    after = _tree_snapshot() or {}
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    assert not changed, f"the test session changed the checkout (git status / content): {', '.join(changed[:20])}"
