"""Deprecated module path: the decoder's layer kernels are `pagedkv.kernels.layer_ops`.

Importing this module warns once and hands back `layer_ops` itself, so attributes set on either
name (a test's monkeypatch) reach the same functions.
"""

import sys
import warnings

from pagedkv.kernels import layer_ops

warnings.warn("pagedkv.kernels.fused is renamed pagedkv.kernels.layer_ops; import that instead",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = layer_ops
