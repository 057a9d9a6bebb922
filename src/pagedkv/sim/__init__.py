"""The serving simulator: the engine's own scheduler, driven against a simulated clock.

A discrete-event simulation of PageFault's stage 4 (mixed-length jobs from closed-loop
clients over a fixed KV pool), naive max-length reservation against paging. Pure Python:
the `Scheduler` and `KVBlockManager` are imported from the engine and core, never copied,
and each step costs the time a `CostModel` gives its shape. The same seed gives the same
numbers on any machine.

    workload.py    jobs: PageFault's length mix, prompt/output split, distinct prompts
    cost_model.py  step time = f(prefill tokens, decode seqs, KV tokens read, swapped tokens); fit, load
    simulator.py   one run: closed-loop clients, the scheduler, the simulated clock, metrics
    sweep.py       many runs (optionally in processes), the watermark sweep, its plot
    fidelity.py    predict a measured engine run's throughput
    cli.py         `pagedkv sim`
    chat_workload.py  open-loop chat requests sharing system prompts (Poisson or bursty arrivals)
    cluster.py     R replicas behind the real router (`engine.router`) on one clock; the replica-count search
    cluster_cli.py `pagedkv sim --cluster`
"""

from pagedkv.sim.cost_model import CostModel, StepMeasurement, fit, load_cost_model, resolve_cost_model
from pagedkv.sim.simulator import SimResult, Simulation, simulate
from pagedkv.sim.workload import Job, jobs_from_lengths, make_jobs

__all__ = [
    "CostModel",
    "Job",
    "SimResult",
    "Simulation",
    "StepMeasurement",
    "fit",
    "jobs_from_lengths",
    "load_cost_model",
    "make_jobs",
    "resolve_cost_model",
    "simulate",
]
