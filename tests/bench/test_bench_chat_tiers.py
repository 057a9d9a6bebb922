"""The chat-tiers bench's turn loop: TTFT over every turn, and apart over the turns that reuse a system prompt."""

import dataclasses
import types

from pagedkv.bench.chat_tiers_run import run_chat
from pagedkv.engine.outputs import CompletionOutput, RequestOutput


class _Engine:
    """Answers each request with one token per step; a prompt that opens with a system prompt no earlier
    request sent waits `cold_steps` extra steps for its first token (a cold prefill). Each step takes one
    second of `clock`."""

    def __init__(self, system_tokens: int, cold_steps: int):
        self.system_tokens, self.cold_steps = system_tokens, cold_steps
        self.clock = 0.0
        self.seen: set = set()
        self.live: dict[str, list] = {}
        self.step_timings = None

    def add_request(self, request_id, prompt, params):
        system = tuple(prompt[:self.system_tokens])
        delay = 0 if system in self.seen else self.cold_steps
        self.seen.add(system)
        self.live[request_id] = [delay, params.max_tokens, []]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.clock += 1.0
        outputs = []
        for request_id, state in list(self.live.items()):
            if state[0] > 0:
                state[0] -= 1
                continue
            state[2].append(7)
            finished = len(state[2]) == state[1]
            outputs.append(RequestOutput(request_id, None, [], [CompletionOutput(0, "", list(state[2]),
                                                                                 "length" if finished else None)],
                                         finished))
            if finished:
                del self.live[request_id]
        if self.step_timings is not None:
            self.step_timings.append(None)
        return outputs


def test_turns_that_reuse_a_system_prompt_are_reported_apart_from_its_first_use(monkeypatch):
    import pagedkv.bench.chat_tiers_run as bench

    engine = _Engine(system_tokens=4, cold_steps=20)
    monkeypatch.setattr(bench, "step_summary", lambda timings: {})
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: engine.clock))
    systems = [[1, 2, 3, 4], [5, 6, 7, 8]]
    # conversation c uses system prompt c % 2; two turns each; the second turn extends the first's history
    turns = [(c, t, systems[c % 2] + [100 + c] * (t + 1), 2) for t in range(2) for c in range(4)]
    run = run_chat(engine, turns, max_in_flight=1, system_tokens=4)
    assert run["num_requests"] == 8 and run["num_reuse_requests"] == 6  # every turn but each system's first
    # one step to a first token, 21 for the two first uses: they set the P99 of all turns, not of the reusing ones
    assert run["ttft_reuse_p50_s"] == run["ttft_reuse_p99_s"] == 1.0
    assert run["ttft_p99_s"] > 20.0
    parts = run["ttft_reuse_parts"]  # one step call each, which the stub does not time
    assert parts["num_turns"] == 6 and parts["steps"] == 1.0
    assert parts["untimed_s"] == parts["ttft_s"] == 1.0 and parts["between_steps_s"] == 0.0


def test_a_turns_ttft_parts_add_up_to_its_ttft():
    from pagedkv.bench.chat_tiers_run import ttft_parts, turn_records
    from pagedkv.engine.outputs import StepTiming
    from pagedkv.engine.scheduler_types import StepShape

    shape = StepShape(prefill_tokens=16, decode_seqs=0, kv_tokens=16)
    timings = [StepTiming(shape, 0.001, 0.002, 0.003, 0.010, 0.004)]  # 20 ms of the second call's 25
    # submitted at t=0; call 0 (an unrelated earlier call) is skipped; call 1, 5 ms, restores only (no timing);
    # call 2, 25 ms, computes; 2 ms between them and 3 ms before the first
    calls = [(-1.0, -0.5, 0, 0), (0.003, 0.008, 0, 0), (0.010, 0.035, 0, 1)]
    records = turn_records(["t"], {"t": 0.035}, {"t"}, {"t": 1}, {"t": 2}, calls, timings)
    parts = ttft_parts(records)
    assert parts["steps"] == 2 and parts["num_turns"] == 1
    assert abs(parts["untimed_s"] - 0.010) < 1e-12  # the restoring call's 5 ms and 5 ms of the other's
    assert abs(parts["between_steps_s"] - 0.005) < 1e-12
    total = sum(parts[key] for key in ("schedule_s", "build_s", "launch_s", "wait_s", "update_s", "untimed_s",
                                       "between_steps_s"))
    assert abs(total - parts["ttft_s"]) < 1e-12 and parts["wait_s"] == 0.010
    assert ttft_parts([]) is None
    twice = ttft_parts(records * 2)  # means over the turns
    assert twice["num_turns"] == 2 and all(twice[key] == parts[key] for key in parts if key != "num_turns")


def test_turn_records_sum_their_steps_moves_and_the_report_names_the_slowest_warm_turns():
    from pagedkv.bench.chat_tiers_report import slowest_turns_line
    from pagedkv.bench.chat_tiers_run import turn_records
    from pagedkv.engine.outputs import StepTiming
    from pagedkv.engine.scheduler_types import StepShape

    def timing(wait_s, **shape):
        return StepTiming(StepShape(prefill_tokens=shape.pop("prefill", 0), decode_seqs=1, kv_tokens=10, **shape),
                          0.0, 0.0, 0.0, wait_s, 0.0)

    timings = [timing(0.100, prefill=64, offloaded_blocks=5), timing(0.002), None,
               timing(0.030, restored_blocks=8, offloaded_blocks=3, pre_spilled_blocks=1, prefill=16)]
    # "a" (cold) calls 0-1; "b" (warm) calls 2-3: a restoring call with no timing, then one that computes
    calls = [(0.0, 0.1, 0, 1), (0.1, 0.11, 1, 2), (0.2, 0.21, 2, 3), (0.21, 0.25, 3, 4)]
    records = turn_records(["a", "b", "lost"], {"a": 0.11, "b": 0.05}, {"b"}, {"a": 0, "b": 2, "lost": 4},
                           {"a": 1, "b": 3}, calls, timings)
    assert [r["id"] for r in records] == ["a", "b"]  # a turn with no first token has no TTFT to report
    a, b = records
    assert (a["steps"], a["spilled"], a["prefill_tokens"], a["reuse"]) == (2, 5, 64, False)
    assert abs(a["wait_s"] - 0.102) < 1e-12 and abs(a["untimed_s"] - 0.008) < 1e-12  # 0.11 s of calls, 0.102 timed
    assert abs(b["untimed_s"] - 0.02) < 1e-12  # the restoring call's 10 ms, and 10 ms of the other's
    assert (b["steps"], b["restored"], b["spilled"], b["pre_spilled"], b["prefill_tokens"]) == (2, 8, 3, 1, 16)
    line = slowest_turns_line(records)
    assert line.startswith("b 50.0 ms (2 steps, wait 30.0 ms, untimed 20.0 ms, restored 8, spilled 3, pre-spilled 1")
    assert line.endswith("after a cold turn)") and "a 110" not in line  # cold turns are not warm turns
    assert slowest_turns_line([a]) == "-"


#: Each optional configuration as the bench defined it: switch -> (label, disk subdirectory, engine overrides).
EXPECTED_EXTRA = {
    "--host-tier-only": ("GPU + host (no disk tier)", None, {}),
    "--disk-writes-during-steps": ("GPU + host + disk, disk writes during steps", "during",
                                   {"kv_offload_disk_writes_during_steps": True}),
    "--disk-writer-process": ("GPU + host + disk, disk writer process", "process",
                              {"kv_offload_disk_writer": "process"}),
    "--late-restore": ("GPU + host + disk, restores issued with the step", "late", {"kv_offload_early_restore": False}),
    "--write-through": ("GPU + host + disk, write-through", "write-through", {"kv_offload_write_through": True}),
}


def test_each_optional_switch_of_bench_engine_adds_its_configuration(tmp_path):
    """One table (`EXTRA_CONFIGS`) gives `pagedkv bench engine` its switches and the bench its configurations:
    through the bench's own parser each switch adds exactly its configuration, with the tiered host tier, a disk
    of its own (or none) and its engine options; no switch adds none."""
    from pagedkv.bench.engine import build_parser
    from pagedkv.bench.engine_chat_tiers import EXTRA_CONFIGS, extra_configs
    from pagedkv.engine.config import EngineConfig

    assert {extra.flag for extra in EXTRA_CONFIGS} == set(EXPECTED_EXTRA)
    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    tiered = dict(kv_offload_memory=2**20, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=2**21)
    parser = build_parser()
    assert extra_configs(parser.parse_args([]), tiered, tmp_path) == []
    for flag, (label, disk, overrides) in EXPECTED_EXTRA.items():
        [(got_label, options)] = extra_configs(parser.parse_args(["--preset", "chat-tiers", flag]), tiered, tmp_path)
        assert got_label == label
        assert set(overrides) <= fields
        if disk is None:
            assert options == {"kv_offload_memory": 2**20, **overrides}
        else:
            assert options == {**tiered, "kv_offload_dir": str(tmp_path / disk), **overrides}
