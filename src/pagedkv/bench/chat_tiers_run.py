"""The chat-tiers bench's turn loop: one run of a multi-turn chat workload through an engine, at a fixed number
of turns in flight, and what it measured: TTFT per turn (over every turn, and over the turns that reuse a system
prompt), output tok/s, the steps' host time per phase with the slowest steps, and the garbage collector's pauses
(a full collection stops the step loop, so a slow step may be one)."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque

from pagedkv.bench.hf_latency import GcWatch
from pagedkv.engine.outputs import STEP_PHASES
from pagedkv.sim.cluster import percentile


def run_chat(engine, turns: list, max_in_flight: int, system_tokens: int = 16, freeze_heap: bool = False) -> dict:
    """`turns` ((conversation, turn, prompt, answer length), `MultiTurnChat.fixed_turns`) through `engine` in
    their order, `max_in_flight` at a time, a turn only once its conversation's turn before it is answered;
    TTFT per turn, output tok/s, and where the steps' host time went.

    TTFT is reported over every turn and, as `ttft_reuse_*`, over the turns whose system prompt an earlier
    turn of the run already sent (`system_tokens` tokens open every prompt): what a server that has run a
    while sees, since a system prompt's first use is a cold prefill in every configuration. With `freeze_heap`
    the heap is frozen for the run, as `pagedkv serve` freezes it after startup."""
    from pagedkv.engine.sampling_params import SamplingParams

    engine.stream_outputs = True
    engine.step_timings = []
    submitted: dict[str, float] = {}
    ttft: dict[str, float] = {}
    prompts: dict[str, list[int]] = {}  # as submitted, in order
    turn_of: dict[str, tuple[int, int]] = {}  # request id -> (conversation, turn)
    systems_sent: set[tuple[int, ...]] = set()
    reuses: set[str] = set()  # the turns whose system prompt an earlier turn sent
    answered: set[tuple[int, int]] = set()
    num_output_tokens = 0
    due = deque(turns)
    if freeze_heap:  # as a server after startup: a full collection then walks only what the run allocates
        gc.collect()
        gc.freeze()
    gc_watch = GcWatch()  # a full collection stops the step loop: the longest pause, beside the slowest step
    gc_watch.active = True
    gc.callbacks.append(gc_watch)
    start = time.perf_counter()
    in_flight = 0
    calls: list[tuple[float, float, int, int]] = []  # per engine.step(): begin, end, its step timings [from, to)
    first_call: dict[str, int] = {}  # request id -> the first step call after its submission
    token_call: dict[str, int] = {}  # request id -> the step call that returned its first token
    while due or engine.has_unfinished_requests():
        while due and in_flight < max_in_flight and (due[0][1] == 0 or (due[0][0], due[0][1] - 1) in answered):
            conversation, turn, prompt, answer_len = due.popleft()
            request_id = f"c{conversation}-t{turn}"
            turn_of[request_id] = (conversation, turn)
            prompts[request_id] = prompt
            system = tuple(prompt[:system_tokens])
            if system in systems_sent:
                reuses.add(request_id)
            systems_sent.add(system)
            submitted[request_id] = time.perf_counter()
            first_call[request_id] = len(calls)
            engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=answer_len,
                                                                  ignore_eos=True))
            in_flight += 1
        begin, timed = time.perf_counter(), len(engine.step_timings)
        outputs = engine.step()
        now = time.perf_counter()
        calls.append((begin, now, timed, len(engine.step_timings)))
        for output in outputs:
            tokens = output.outputs[0].token_ids
            if output.request_id not in ttft and tokens:
                ttft[output.request_id] = now - submitted[output.request_id]
                token_call[output.request_id] = len(calls) - 1
            if output.finished:
                in_flight -= 1
                num_output_tokens += len(tokens)
                answered.add(turn_of[output.request_id])
    elapsed = time.perf_counter() - start
    gc.callbacks.remove(gc_watch)
    if freeze_heap:
        gc.unfreeze()  # the engine's objects may be collected again once it is dropped
    timings, engine.step_timings = engine.step_timings, None
    values = list(ttft.values())
    records = turn_records(list(submitted), ttft, reuses, first_call, token_call, calls, timings)
    reusing = [value for request_id, value in ttft.items() if request_id in reuses]
    return {"elapsed_s": elapsed, "num_requests": len(values), "num_output_tokens": num_output_tokens,
            "output_tokens_per_s": num_output_tokens / elapsed, "ttft_p50_s": percentile(values, 50),
            "ttft_p99_s": percentile(values, 99), "ttft_mean_s": sum(values) / len(values),
            "num_reuse_requests": len(reusing), "ttft_reuse_p50_s": percentile(reusing, 50) if reusing else None,
            "ttft_reuse_p99_s": percentile(reusing, 99) if reusing else None,
            "steps": step_summary(timings),
            "ttft_reuse_parts": ttft_parts([record for record in records if record["reuse"]]),
            "turns": records,
            "gc_collections": gc_watch.collections,
            "gc_max_pause_s": max((end - begin for begin, end in gc_watch.pauses), default=0.0), "prompts": prompts}


def turn_records(order: list[str], ttft: dict, reuses: set, first_call: dict, token_call: dict,
                 calls: list[tuple[float, float, int, int]], timings: list) -> list[dict]:
    """Per turn in submission order: its TTFT, whether an earlier turn sent its system prompt (`reuse`), and over
    the step calls from its submission to its first token: how many (`steps`), their host time by phase, the time
    in calls that no step timing covers (`untimed_s`: steps with nothing to compute, such as one that only
    restores), the time between the calls (`between_steps_s`: submitting, the loop's own work; the parts add up to
    `ttft_s`), and the blocks the timed steps moved (restored beside and in the step, spilled, pre-spilled) and
    prefill tokens computed (of every request in them): what sets a slow warm turn apart. A step with nothing to
    compute has no timing, so the moves of a turn's restore-only step (its restore, and the spills its admission
    caused) are not counted here."""
    records = []
    for request_id in order:
        if request_id not in ttft:
            continue
        record = {"id": request_id, "ttft_s": ttft[request_id], "reuse": request_id in reuses,
                  "steps": token_call[request_id] - first_call[request_id] + 1,
                  **dict.fromkeys(STEP_PHASES, 0.0), "untimed_s": 0.0, "between_steps_s": ttft[request_id],
                  "restored": 0, "restored_in_step": 0, "spilled": 0, "pre_spilled": 0, "prefill_tokens": 0}
        for begin, end, lo, hi in calls[first_call[request_id]:token_call[request_id] + 1]:
            record["untimed_s"] += end - begin
            record["between_steps_s"] -= end - begin
            for timing in timings[lo:hi]:
                if timing is None:
                    continue
                record["untimed_s"] -= timing.total_s
                for phase in STEP_PHASES:
                    record[phase] += getattr(timing, phase)
                shape = timing.shape
                record["restored"] += shape.restored_blocks
                record["restored_in_step"] += shape.restored_in_step_blocks
                record["spilled"] += shape.offloaded_blocks
                record["pre_spilled"] += shape.pre_spilled_blocks
                record["prefill_tokens"] += shape.prefill_tokens
        records.append(record)
    return records


def ttft_parts(records: list[dict]) -> dict | None:
    """Where the TTFT of the turns of `records` (`turn_records`) went, as means over them in seconds: the step
    calls in between (`steps`, how many) by phase, `untimed_s` and `between_steps_s`; the parts add up to
    `ttft_s`. None for no turns."""
    if not records:
        return None
    keys = ("ttft_s", "steps", *STEP_PHASES, "untimed_s", "between_steps_s")
    return {"num_turns": len(records), **{key: sum(r[key] for r in records) / len(records) for key in keys}}


def step_summary(timings: list, num_slowest: int = 3) -> dict:
    """Host seconds per phase of the steps (`LLMEngine.step_timings`) and the slowest steps: what a config adds."""
    phases = STEP_PHASES
    slowest = sorted(timings, key=lambda t: t.total_s, reverse=True)[:num_slowest]
    return {"num_steps": len(timings), **{phase: sum(getattr(t, phase) for t in timings) for phase in phases},
            "slowest": [{"total_s": t.total_s, **{phase: getattr(t, phase) for phase in phases},
                         "shape": dataclasses.asdict(t.shape)} for t in slowest]}
