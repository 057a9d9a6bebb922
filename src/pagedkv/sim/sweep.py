"""Many simulations at once: naive vs paged, and the watermark sweep over victim policies and preemption modes.

Every run is independent and deterministic, so runs may go to worker processes: the rows
come back in task order and are the same numbers whatever the number of workers.

A sweep's rows, one per (preemption mode, victim policy, watermark), plus the naive
baseline (max_model_len reserved per sequence, watermark 0: it never grows, so it needs no
reserve), each carry `throughput_vs_naive`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence as SequenceT
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedkv.engine.scheduler_types import PreemptionMode, SchedulerConfig, VictimPolicy
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.simulator import SimResult, simulate
from pagedkv.sim.workload import Job

#: PageFault's sweep points, 0-50% of the pool kept free at admission.
DEFAULT_WATERMARKS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.10, 0.20, 0.30, 0.50)
ALL_VICTIMS: tuple[str, ...] = tuple(policy.value for policy in VictimPolicy)
ALL_PREEMPTIONS: tuple[str, ...] = tuple(mode.value for mode in PreemptionMode)


@dataclass(frozen=True)
class Run:
    """One simulation to do: a label and the scheduler config it runs."""

    mode: str  # "naive", "paged" or "paged per group" (a table per layer group)
    config: SchedulerConfig

    def row(self, result: SimResult) -> dict:
        """The run's table/JSON row: its settings, then its metrics."""
        cfg = self.config
        paged = self.mode != "naive"
        return {
            "mode": self.mode,
            "preemption": cfg.preemption_mode.value if paged else None,
            "victim": cfg.victim_policy.value if paged else None,
            "watermark": cfg.watermark,
            **result.to_dict(),
        }


def naive_config(base: SchedulerConfig) -> SchedulerConfig:
    """The naive baseline of `base`: max_model_len reserved per sequence, no watermark, no prefix cache."""
    return dataclasses.replace(base, reservation="naive", watermark=0.0, enable_prefix_caching=False,
                               preemption_mode=PreemptionMode.RECOMPUTE, num_swap_blocks=0)


def paged_config(base: SchedulerConfig, watermark: float, preemption: str, victim: str,
                 num_swap_blocks: int) -> SchedulerConfig:
    """`base` with paging and these policies (swap space only where swapping)."""
    swap = num_swap_blocks if PreemptionMode(preemption) is PreemptionMode.SWAP else 0
    return dataclasses.replace(base, reservation="paged", watermark=watermark, preemption_mode=preemption,
                               victim_policy=victim, num_swap_blocks=swap)


def sweep_runs(base: SchedulerConfig, watermarks: SequenceT[float], preemptions: SequenceT[str],
               victims: SequenceT[str], num_swap_blocks: int) -> list[Run]:
    """The naive baseline first, then every (preemption, victim, watermark), validated before any run."""
    runs = [Run("naive", naive_config(base))]
    for preemption in preemptions:
        for victim in victims:
            for watermark in watermarks:
                runs.append(Run("paged", paged_config(base, watermark, preemption, victim, num_swap_blocks)))
    return runs


# Worker-process state: the jobs and cost model every run of one batch shares.
_WORKER_ARGS: tuple[list[Job], CostModel, int | None] | None = None


def _init_worker(jobs: list[Job], cost_model: CostModel, num_clients: int | None) -> None:
    global _WORKER_ARGS
    _WORKER_ARGS = (jobs, cost_model, num_clients)


def _simulate_in_worker(config: SchedulerConfig) -> SimResult:
    jobs, cost_model, num_clients = _WORKER_ARGS
    return simulate(config, jobs, cost_model, num_clients)


def default_workers() -> int:
    """Worker processes for a batch of runs: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def run_all(runs: SequenceT[Run], jobs: SequenceT[Job], cost_model: CostModel, num_clients: int | None,
            workers: int = 1) -> list[dict]:
    """Simulate every run (in `workers` processes) and return their rows in order, with throughput_vs_naive."""
    jobs = list(jobs)
    configs = [run.config for run in runs]
    if workers <= 1 or len(runs) <= 1:
        results = [simulate(config, jobs, cost_model, num_clients) for config in configs]
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(runs)), initializer=_init_worker,
                                 initargs=(jobs, cost_model, num_clients)) as pool:
            results = list(pool.map(_simulate_in_worker, configs, chunksize=1))
    rows = [run.row(result) for run, result in zip(runs, results)]
    naive = next((row["throughput_tokens_per_s"] for row in rows if row["mode"] == "naive"), None)
    for row in rows:
        row["throughput_vs_naive"] = row["throughput_tokens_per_s"] / naive if naive else None
    return rows


def series_label(row: dict) -> str:
    """'recompute/newest' for a paged row, 'naive' for the baseline."""
    return "naive" if row["mode"] == "naive" else f"{row['preemption']}/{row['victim']}"


def best_watermarks(rows: SequenceT[dict]) -> dict[str, dict]:
    """Per paged series, its row of highest throughput (the smallest watermark on a tie)."""
    best: dict[str, dict] = {}
    for row in rows:
        if row["mode"] != "paged":
            continue
        label = series_label(row)
        if label not in best or row["throughput_tokens_per_s"] > best[label]["throughput_tokens_per_s"]:
            best[label] = row
    return best


def smallest_good_watermarks(rows: SequenceT[dict], tolerance: float = 0.01) -> dict[str, dict]:
    """Per paged series, its smallest-watermark row within `tolerance` of the series' best throughput.

    The throughput curves are flat near their peak, so "the best reserve" is better read as
    the smallest reserve that gets (almost) all of the benefit.
    """
    best = best_watermarks(rows)
    good: dict[str, dict] = {}
    for row in sorted((r for r in rows if r["mode"] == "paged"), key=lambda r: r["watermark"]):
        label = series_label(row)
        if label not in good and row["throughput_tokens_per_s"] >= (1 - tolerance) * best[label]["throughput_tokens_per_s"]:
            good[label] = row
    return good


def plot_sweep(rows: SequenceT[dict], path: str | os.PathLike, title: str) -> Path:
    """Throughput vs watermark, one line per series, naive as a horizontal line; written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    # Watermarks sit at even spacing (0, 1, 2, 5% would crowd together on a linear axis).
    watermarks = sorted({row["watermark"] for row in rows if row["mode"] == "paged"})
    position = {w: i for i, w in enumerate(watermarks)}
    series: dict[str, list[dict]] = {}
    for row in rows:
        if row["mode"] == "paged":
            series.setdefault(series_label(row), []).append(row)
    colors = {victim: f"C{i}" for i, victim in enumerate(ALL_VICTIMS)}
    for label, points in series.items():
        points = sorted(points, key=lambda r: r["watermark"])
        ax.plot([position[p["watermark"]] for p in points], [p["throughput_tokens_per_s"] for p in points],
                "--" if points[0]["preemption"] == "swap" else "-", marker="o", markersize=4,
                color=colors.get(points[0]["victim"]), label=label)
    for row in rows:
        if row["mode"] == "naive":
            ax.axhline(row["throughput_tokens_per_s"], color="black", linestyle=":", label="naive (max_model_len)")
    ax.set_xticks(range(len(watermarks)), [f"{100 * w:g}%" for w in watermarks])
    ax.set_xlabel("watermark (share of the pool kept free at admission)")
    ax.set_ylabel("throughput (output tokens / simulated s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path
