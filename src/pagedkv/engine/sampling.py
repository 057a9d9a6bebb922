"""Deprecated module path: `SamplingParams` lives in `pagedkv.engine.sampling_params` (or import it from `pagedkv`).

Importing this module warns once and hands back `sampling_params` itself.
"""

import sys
import warnings

from pagedkv.engine import sampling_params

warnings.warn("pagedkv.engine.sampling is renamed pagedkv.engine.sampling_params; import SamplingParams from "
              "there or from pagedkv", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = sampling_params
