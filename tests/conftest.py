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
