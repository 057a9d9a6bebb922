"""Deprecated alias: the model loader moved to `pagedkv.models.loader` (next to the own decoder).

`from pagedkv.hf import load_model, load_tokenizer, random_model` keeps working unchanged.
"""

import warnings

from pagedkv.models.loader import *  # noqa: F401,F403
from pagedkv.models.loader import __all__  # noqa: F401

warnings.warn("pagedkv.hf.models moved to pagedkv.models.loader", DeprecationWarning, stacklevel=2)
