"""The discrete-event simulator: the engine's own `Scheduler` against a simulated clock.

No threads and no wall clock: one loop iteration is one engine step. The scheduler (and
through it the block manager) decides the step exactly as in the engine; a fake model
"samples" a deterministic token for every sequence whose chunk reached its last token; the
step costs `CostModel.step_time_s(shape)` simulated seconds. The same jobs and config give
the same numbers on any machine.

Arrivals are a closed loop: `num_clients` clients each submit a job, and submit the next
unsubmitted job the moment theirs finishes, until every job is done (`num_clients=None`
submits everything at time 0, an offline batch). A job submitted at the end of step k can
be admitted in step k + 1, which starts at that same instant:

    clock  | step k ........... | step k+1 ......... |
           t                 t + dt_k
             job j finishes ──┘└── job j' submitted, and admitted if the pool allows

Metrics (all in simulated time):
- throughput: output tokens of finished jobs / total simulated time;
- decoding sequences: time-weighted mean of the step's decode rows (one query token);
- admission wait: mean of (start of the first step that schedules the job - submission);
- preemptions, recomputes, swaps as the scheduler counts them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT
from dataclasses import asdict, dataclass

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig, SchedulerOutput, StepShape
from pagedkv.engine.sequence import FinishReason, Sequence
from pagedkv.errors import RequestRejectedError, require_positive_int
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.workload import DEFAULT_VOCAB_SIZE, Job


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured (times in simulated seconds)."""

    num_jobs: int
    num_finished: int
    num_rejected: int
    num_steps: int
    sim_time_s: float
    num_output_tokens: int
    throughput_tokens_per_s: float
    mean_decoding_seqs: float
    mean_running_seqs: float
    peak_running_seqs: int
    mean_admission_wait_s: float
    num_preemptions: int
    num_recomputes: int
    num_swap_outs: int
    num_swap_ins: int
    num_prefill_tokens: int  # computed prompt (and recomputed) tokens, prefix hits excluded
    num_prefix_hit_tokens: int
    num_swapped_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def fake_step(out: SchedulerOutput, block_size: int,
              vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[StepShape, dict[int, int]]:
    """Run a scheduled step without a model: its shape (the scheduler's one definition) and a
    deterministic token per sampling sequence."""
    sampled: dict[int, int] = {}
    vocab = vocab_size - 1
    for item in out.scheduled:
        seq = item.seq
        end = item.start + item.num_new_tokens
        if end == len(seq.token_ids):
            # Any deterministic token will do: ignore_eos and max_tokens decide the length.
            sampled[seq.seq_id] = 1 + (seq.seq_id * 7919 + end) % vocab
    return out.shape, sampled


def job_sequence(job: Job, seq_id: int) -> Sequence:
    """A job as a new engine `Sequence` that generates exactly its output length; `seq_id` is its arrival order."""
    params = SamplingParams(max_tokens=job.num_output_tokens, ignore_eos=True)
    return Sequence(seq_id, f"job-{job.job_id}", list(job.prompt_token_ids), params,
                    arrival_index=seq_id, priority=job.priority)


class Simulation:
    """One run: a fresh `Scheduler` for `config`, fed `jobs` by `num_clients` closed-loop clients."""

    def __init__(self, config: SchedulerConfig, jobs: SequenceT[Job], cost_model: CostModel,
                 num_clients: int | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
        require_positive_int("jobs", len(jobs))
        if num_clients is not None:
            require_positive_int("clients", num_clients)
        self.config = config
        self.jobs = list(jobs)
        self.cost_model = cost_model
        self.num_clients = len(self.jobs) if num_clients is None else min(num_clients, len(self.jobs))
        self.vocab_size = vocab_size
        self.scheduler = Scheduler(config)

    def _sequence(self, index: int) -> Sequence:
        # Sequence ids are submission indices (job ids need not be contiguous); arrival order is submission order.
        return job_sequence(self.jobs[index], index)

    def run(self) -> SimResult:
        """Simulate until every job has finished (or was rejected as never fitting)."""
        scheduler = self.scheduler
        cost = self.cost_model
        block_size = self.config.block_size
        num_jobs = len(self.jobs)
        submit_time = [0.0] * num_jobs
        first_scheduled: list[float | None] = [None] * num_jobs
        clock = 0.0
        next_job = 0
        num_finished = num_rejected = num_output_tokens = 0
        num_steps = num_prefill_total = num_swapped_total = peak_running = 0
        decoding_time = running_time = 0.0

        def submit(now: float) -> None:
            # A rejected job frees its client at once, so keep going until one is queued.
            nonlocal next_job, num_rejected
            while next_job < num_jobs:
                index = next_job
                next_job += 1
                submit_time[index] = now
                try:
                    scheduler.add(self._sequence(index))
                    return
                except RequestRejectedError:
                    num_rejected += 1

        for _ in range(self.num_clients):
            submit(clock)

        while scheduler.has_unfinished():
            out = scheduler.schedule()
            scheduled = out.scheduled
            if not scheduled and not out.preempted:
                raise AssertionError(f"scheduler stalled at step {num_steps} with {scheduler.num_unfinished} "
                                     f"unfinished sequences and {scheduler.block_manager.num_free_blocks} free blocks")
            shape, sampled = fake_step(out, block_size, self.vocab_size)
            for item in scheduled:
                if first_scheduled[item.seq.seq_id] is None:
                    first_scheduled[item.seq.seq_id] = clock
            dt = cost.step_time_s(shape.prefill_tokens, shape.decode_seqs, shape.kv_tokens, shape.swapped_blocks * block_size)
            num_running = len(scheduler.running)
            peak_running = max(peak_running, num_running)
            decoding_time += shape.decode_seqs * dt
            running_time += num_running * dt
            num_prefill_total += shape.prefill_tokens
            num_swapped_total += shape.swapped_blocks * block_size
            num_steps += 1
            clock += dt
            for seq in scheduler.update(out, sampled):
                if seq.finish_reason is FinishReason.LENGTH:
                    num_finished += 1
                    num_output_tokens += seq.num_output_tokens
                submit(clock)

        stats = scheduler.stats
        waits = [first - submit_time[i] for i, first in enumerate(first_scheduled) if first is not None]
        return SimResult(
            num_jobs=num_jobs,
            num_finished=num_finished,
            num_rejected=num_rejected,
            num_steps=num_steps,
            sim_time_s=clock,
            num_output_tokens=num_output_tokens,
            throughput_tokens_per_s=num_output_tokens / clock if clock > 0 else 0.0,
            mean_decoding_seqs=decoding_time / clock if clock > 0 else 0.0,
            mean_running_seqs=running_time / clock if clock > 0 else 0.0,
            peak_running_seqs=peak_running,
            mean_admission_wait_s=sum(waits) / len(waits) if waits else 0.0,
            num_preemptions=stats.num_preemptions,
            num_recomputes=stats.num_recomputes,
            num_swap_outs=stats.num_swap_outs,
            num_swap_ins=stats.num_swap_ins,
            num_prefill_tokens=num_prefill_total,
            num_prefix_hit_tokens=scheduler.block_manager.num_prefix_hit_tokens,
            num_swapped_tokens=num_swapped_total,
        )


def simulate(config: SchedulerConfig, jobs: SequenceT[Job], cost_model: CostModel,
             num_clients: int | None = None) -> SimResult:
    """Run one simulation and return its metrics (see `Simulation`)."""
    return Simulation(config, jobs, cost_model, num_clients).run()
