"""The step-time cost model: what one engine step costs, as a linear function of its shape.

    t_step = c0 + c_prefill * prefill_tokens + c_decode * decode_seqs + c_kv * kv_tokens
              + c_swap * swapped_tokens

- `prefill_tokens`: query tokens of the step's prefill chunks (a chunk of 1 counts as a decode);
- `decode_seqs`: sequences with one query token;
- `kv_tokens`: context tokens attention reads, the sum of every scheduled sequence's context
  length after the step (`start + num_new_tokens`), for decodes and prefills alike;
- `swapped_tokens`: block_size * (blocks swapped out + blocks swapped in) this step, each
  copied over PCIe.

The CLI's default is the calibrated model that ships inside the package
(`pagedkv/sim/data/cost_model_h200.json`: the constants fitted to the H200 engine's measured
steps), so an answer never depends on the working directory. `CostModel()` holds the
uncalibrated constants below, of a plausible order for a ~0.6B model (Qwen3-0.6B: 28 layers, 8 KV heads, head_dim 128, bf16, so
2 * 28 * 8 * 128 * 2 = 114,688 B of KV per token) on an H200:

    c0        4 ms          kernel launches and Python per step (HF model, no CUDA graphs)
    c_prefill 20 us/token   ~50k prefill tokens/s
    c_decode  30 us/seq     sampling, per-row packing and the per-sequence matmul share
    c_kv      25 ns/token   114,688 B / ~4.8 TB/s of HBM bandwidth
    c_swap    2.3 us/token  114,688 B / ~50 GB/s (PCIe 5 x16, pinned host memory)

`c_swap` is not fitted (engine step measurements carry no swaps); a cost-model file may
set it.

KV tiers add what their copies cost, from pinned copy bandwidths, the on-device gather rate and
the KV bytes per token: the step that reuses a spilled block waits only for its gather on the
device (`offloaded_tokens * kv_bytes_per_token / gather_bytes_per_s`), and its copy to the host
(device -> host) runs beside the steps on a stream of its own; a restore (host -> device) before
the step's kernels (its request computes in the step) adds its whole copy, one beside the step
only what it takes beyond the step's own time. The copies to the host are charged the same way,
beyond the step's time (a conservative model: no step waits for them until they fall behind by
more than the runner's cap on bytes in flight). A file's `"kv_tiers"` object sets them (the
packaged file's say whether they were measured):

    "kv_tiers": {"h2d_bytes_per_s": 5.0e10, "d2h_bytes_per_s": 5.0e10, "gather_bytes_per_s": 1.4e12,
                 "disk_read_bytes_per_s": 3.0e9, "kv_bytes_per_token": 114688, "measured": false, "note": "..."}

Cost-model file (`cost_model.json`, written by `pagedkv bench engine` into its --out):

    {
      "model": "Qwen/Qwen3-0.6B",              # what was measured
      "gpu": "NVIDIA H200",
      "measurements": [                         # one entry per measured engine step
        {"prefill_tokens": 0, "decode_seqs": 64, "kv_tokens": 41234, "seconds": 0.0061},
        ...
      ],
      "constants": {                            # optional: fitted from "measurements" when absent
        "c0_s": 0.004, "prefill_s_per_token": 2e-5, "decode_s_per_seq": 3e-5,
        "kv_s_per_token": 2.5e-8,
        "swap_s_per_token": 2.3e-6              # optional: the default above when absent
      },
      "provenance": {...}                       # optional, as pagedkv.results.provenance()
    }
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path

from pagedkv.errors import ConfigError, InvalidArgumentError

#: The calibrated cost model inside the package (see the module docstring).
PACKAGED_COST_MODEL = "cost_model_h200.json"

_FITTED = ("c0_s", "prefill_s_per_token", "decode_s_per_seq", "kv_s_per_token")


@dataclass(frozen=True)
class StepMeasurement:
    """One measured engine step: its shape and its wall time."""

    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    seconds: float

    def __post_init__(self):
        for name in ("prefill_tokens", "decode_seqs", "kv_tokens", "seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(f"step measurement {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class CostModel:
    """Step time from a step's shape (see the module docstring). All constants in seconds."""

    c0_s: float = 4e-3
    prefill_s_per_token: float = 20e-6
    decode_s_per_seq: float = 30e-6
    kv_s_per_token: float = 25e-9
    swap_s_per_token: float = 2.3e-6
    source: str = "default constants (~0.6B model on an H200; not calibrated)"
    # KV tiers (see the module docstring): pinned copy bandwidths and what one token's KV weighs
    h2d_bytes_per_s: float = 50e9
    d2h_bytes_per_s: float = 50e9
    gather_bytes_per_s: float = 1.4e12  # spilled blocks gathered on the device (the step waits for this only)
    disk_read_bytes_per_s: float = 3e9
    kv_bytes_per_token: float = 114_688
    tiers_measured: bool = False  # whether the bandwidths above were measured (else placeholders)

    def __post_init__(self):
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "gather_bytes_per_s", "disk_read_bytes_per_s",
                     "kv_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"cost model {name} must be a finite number > 0, got {value!r}")
        for name in (*_FITTED, "swap_s_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"cost model {name} must be a finite number >= 0, got {value!r}")
        if self.c0_s + self.prefill_s_per_token + self.decode_s_per_seq + self.kv_s_per_token <= 0:
            raise ConfigError("cost model: every constant is 0, so steps would take no time")

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, swapped_tokens: int = 0) -> float:
        """Simulated seconds of one step of this shape."""
        return (self.c0_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decode_seqs
                + self.kv_s_per_token * kv_tokens + self.swap_s_per_token * swapped_tokens)

    def tier_copy_s(self, step_s: float, offloaded_tokens: int, restored_tokens: int, disk_tokens: int = 0,
                    pre_spilled_tokens: int = 0, restored_in_step_tokens: int = 0) -> float:
        """What a step's KV-tier copies add to its `step_s`, as the runner orders them (`KVOffload`): disk reads,
        in-step restores and the spills' gather on the device in full; beside the step, only what runs past it:
        the copy stream's restores then pre-spill gather, and the out stream's copies to the host, the spills'
        first, the pre-spills' once their gather (after the restores) is done."""
        kv = self.kv_bytes_per_token
        spill_s = offloaded_tokens * kv / self.gather_bytes_per_s
        copy_stream_s = (restored_tokens * kv / self.h2d_bytes_per_s
                         + pre_spilled_tokens * kv / self.gather_bytes_per_s)
        out_stream_s = offloaded_tokens * kv / self.d2h_bytes_per_s
        if pre_spilled_tokens:
            out_stream_s = max(out_stream_s, copy_stream_s) + pre_spilled_tokens * kv / self.d2h_bytes_per_s
        return (spill_s + disk_tokens * kv / self.disk_read_bytes_per_s
                + restored_in_step_tokens * kv / self.h2d_bytes_per_s
                + max(0.0, copy_stream_s - step_s, out_stream_s - step_s))

    def with_kv_bytes(self, ratio: float, what: str) -> CostModel:
        """This model for a KV cache of `ratio` times the bytes per token (FP8 over bf16: 0.5).

        Only the terms that move K/V bytes scale: reading the context (`kv_s_per_token`, decode
        being bound by memory) and swapping blocks over PCIe (`swap_s_per_token`).
        """
        if not ratio > 0:
            raise InvalidArgumentError(f"the KV bytes ratio must be > 0, got {ratio}")
        return replace(self, kv_s_per_token=self.kv_s_per_token * ratio,
                       swap_s_per_token=self.swap_s_per_token * ratio,
                       kv_bytes_per_token=self.kv_bytes_per_token * ratio, source=f"{self.source}, {what}")

    def constants(self) -> dict[str, float]:
        """The constants under their file names."""
        return {k: v for k, v in asdict(self).items() if k not in ("source", "tiers_measured")}

    def describe(self) -> str:
        """One line: where the constants come from, and their values."""
        return (f"cost model: {self.source}: c0 {self.c0_s * 1e3:.3g} ms, prefill {self.prefill_s_per_token * 1e6:.3g} "
                f"us/token, decode {self.decode_s_per_seq * 1e6:.3g} us/seq, kv {self.kv_s_per_token * 1e9:.3g} "
                f"ns/token, swap {self.swap_s_per_token * 1e6:.3g} us/token")


def fit(measurements: Sequence[StepMeasurement], swap_s_per_token: float = CostModel.swap_s_per_token,
        source: str = "fitted") -> CostModel:
    """Least-squares constants >= 0 from measured steps (exact NNLS over the 4 parameters).

    With four parameters, non-negative least squares is solved exactly by trying every subset
    of parameters allowed to be non-zero (16 ordinary least-squares solves) and keeping the
    feasible one with the smallest residual. Columns are scaled to unit norm first, since
    kv_tokens is ~1e5 times the constant column.
    """
    import numpy as np

    if len(measurements) < 1:
        raise InvalidArgumentError("fit needs at least one step measurement")
    a = np.array([[1.0, m.prefill_tokens, m.decode_seqs, m.kv_tokens] for m in measurements], dtype=np.float64)
    y = np.array([m.seconds for m in measurements], dtype=np.float64)
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms
    best, best_residual = np.zeros(4), float(np.sum(y * y))
    for size in range(1, 5):
        for active in itertools.combinations(range(4), size):
            cols = list(active)
            coef, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((scaled[:, cols] @ coef - y) ** 2))
            if residual < best_residual * (1 - 1e-12):
                best = np.zeros(4)
                best[cols] = coef
                best_residual = residual
    constants = best / norms
    return CostModel(*(float(c) for c in constants), swap_s_per_token=swap_s_per_token,
                     source=f"{source} from {len(measurements)} steps")


def load_cost_model(path: str | Path, *, name: str | None = None) -> CostModel:
    """The cost model of a file in the schema above: its constants, or a fit of its measurements.

    `name` stands for the path in the model's `source` (the packaged file's install path
    differs between machines; its name does not).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read cost model {path}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"cost model {path}: expected a JSON object, got {type(data).__name__}")
    what = " ".join(str(data[k]) for k in ("model", "gpu") if data.get(k)) or "unnamed"
    label = name or str(path)
    tiers = _tier_fields(data.get("kv_tiers"), path)
    constants = data.get("constants")
    swap = CostModel.swap_s_per_token
    if isinstance(constants, dict) and constants.get("swap_s_per_token") is not None:
        swap = constants["swap_s_per_token"]
    if isinstance(constants, dict) and all(constants.get(k) is not None for k in _FITTED):
        return CostModel(*(constants[k] for k in _FITTED), swap_s_per_token=swap, source=f"{label} ({what})",
                         **tiers)
    rows = data.get("measurements")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"cost model {path}: needs 'constants' ({', '.join(_FITTED)}) or a 'measurements' list")
    try:
        measurements = [StepMeasurement(r["prefill_tokens"], r["decode_seqs"], r["kv_tokens"], r["seconds"])
                        for r in rows]
    except (KeyError, TypeError) as error:
        raise ConfigError(f"cost model {path}: each measurement needs prefill_tokens, decode_seqs, kv_tokens, "
                          f"seconds ({error!r})") from None
    return replace(fit(measurements, swap_s_per_token=swap, source=f"{label} ({what}), fitted"), **tiers)


def _tier_fields(section, path) -> dict:
    """`CostModel` fields from a file's optional "kv_tiers" object."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"cost model {path}: 'kv_tiers' must be an object, got {type(section).__name__}")
    fields = {name: section[name] for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "gather_bytes_per_s",
                                               "disk_read_bytes_per_s", "kv_bytes_per_token")
              if section.get(name) is not None}
    fields["tiers_measured"] = section.get("measured") is True
    return fields


def packaged_cost_model() -> CostModel:
    """The calibrated cost model shipped inside the package (`PACKAGED_COST_MODEL`)."""
    with resources.as_file(resources.files("pagedkv.sim") / "data" / PACKAGED_COST_MODEL) as path:
        return load_cost_model(path, name=f"packaged {PACKAGED_COST_MODEL}")


def resolve_cost_model(path: str | Path | None = None) -> CostModel:
    """The file at `path`, else the packaged calibrated model: never a file found through the working directory."""
    if path is not None:
        return load_cost_model(path)
    return packaged_cost_model()
