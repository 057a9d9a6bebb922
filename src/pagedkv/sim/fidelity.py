"""Fidelity: predict a measured engine run's throughput, and say how far off the prediction is.

The engine benchmark writes what it ran and what it measured; the simulator replays the same
workload through the same scheduler config under the cost model, and compares. The target
is a relative error within 15%.

Engine-run file (written by the engine benchmark, read by `pagedkv sim --fidelity PATH`):

    {
      "model": "Qwen/Qwen3-0.6B", "gpu": "NVIDIA H200",       # optional, for the printout
      "workload": {
        "prompt_lens": [412, 87, ...],                          # required: one per request
        "output_lens": [733, 1024, ...],                        # required: tokens generated (ignore_eos)
        "clients": null                                         # optional: null = all submitted at once
      },                                                        #   (offline); N = closed loop of N clients
      "engine": {
        "num_blocks": 4096, "block_size": 16,                   # required
        "max_num_seqs": 256, "max_num_batched_tokens": 2048,    # required
        "max_model_len": 4096,                                  # optional: default max(prompt + output)
        "watermark": 0.01, "preemption_mode": "recompute",      # optional: SchedulerConfig defaults
        "victim_policy": "newest", "num_swap_blocks": 0,
        "enable_prefix_caching": true, "enable_chunked_prefill": true
      },
      "measured": {"output_tokens_per_s": 9876.5,               # required
                   "elapsed_s": 25.9, "num_output_tokens": 133966},   # optional
      "provenance": {...}                                       # optional
    }

Prompts are replayed with distinct seeded token ids (no shared prefixes), as in the
benchmark's random prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.simulator import SimResult, simulate
from pagedkv.sim.workload import Job, jobs_from_lengths

TARGET_RELATIVE_ERROR = 0.15

_REQUIRED_ENGINE = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")
_OPTIONAL_ENGINE = ("max_model_len", "watermark", "preemption_mode", "victim_policy", "num_swap_blocks",
                    "enable_prefix_caching", "enable_chunked_prefill")


@dataclass(frozen=True)
class EngineRun:
    """A measured engine run: what ran, under which scheduler config, and its throughput."""

    name: str
    jobs: list[Job]
    config: SchedulerConfig
    num_clients: int | None
    measured_tokens_per_s: float


@dataclass(frozen=True)
class FidelityResult:
    """Measured vs simulated throughput of one engine run."""

    name: str
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    sim: SimResult

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_tokens_per_s - self.measured_tokens_per_s) / self.measured_tokens_per_s

    @property
    def is_within_target(self) -> bool:
        return abs(self.relative_error) <= TARGET_RELATIVE_ERROR


def _section(data: dict, name: str, path: Path) -> dict:
    section = data.get(name)
    if not isinstance(section, dict):
        raise ConfigError(f"engine run {path}: missing the '{name}' object")
    return section


def load_engine_run(path: str | Path) -> EngineRun:
    """Read an engine-run file (schema above); raises `ConfigError` naming what is missing or bad."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read engine run {path}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"engine run {path}: expected a JSON object, got {type(data).__name__}")
    workload, engine, measured = (_section(data, name, path) for name in ("workload", "engine", "measured"))
    prompt_lens, output_lens = workload.get("prompt_lens"), workload.get("output_lens")
    if not isinstance(prompt_lens, list) or not isinstance(output_lens, list) or not prompt_lens:
        raise ConfigError(f"engine run {path}: workload needs non-empty 'prompt_lens' and 'output_lens' lists")
    missing = [key for key in _REQUIRED_ENGINE if key not in engine]
    if missing:
        raise ConfigError(f"engine run {path}: engine is missing {', '.join(missing)}")
    throughput = measured.get("output_tokens_per_s")
    if isinstance(throughput, bool) or not isinstance(throughput, (int, float)) or not throughput > 0:
        raise ConfigError(f"engine run {path}: measured.output_tokens_per_s must be a number > 0, got {throughput!r}")
    try:
        jobs = jobs_from_lengths(prompt_lens, output_lens)
        fields = {key: engine[key] for key in (*_REQUIRED_ENGINE, *_OPTIONAL_ENGINE) if engine.get(key) is not None}
        fields.setdefault("max_model_len", max(job.num_tokens for job in jobs))
        config = SchedulerConfig(**fields)
    except PagedKVError as error:
        raise ConfigError(f"engine run {path}: {error}") from None
    name = " on ".join(str(data[k]) for k in ("model", "gpu") if data.get(k)) or path.name
    return EngineRun(name, jobs, config, workload.get("clients"), float(throughput))


def predict(run: EngineRun, cost_model: CostModel) -> FidelityResult:
    """Simulate the engine run's workload and compare with its measured throughput."""
    result = simulate(run.config, run.jobs, cost_model, run.num_clients)
    return FidelityResult(run.name, run.measured_tokens_per_s, result.throughput_tokens_per_s, result)
