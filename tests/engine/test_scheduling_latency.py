"""Scheduling for latency: a long prompt never starves running decodes, and under async scheduling a request
with stop strings keeps the steps overlapped, at the cost of at most one discarded token."""

import pytest
import torch

from helpers import tiny
from pagedkv import LLM, SamplingParams

BUDGET = 16  # max_num_batched_tokens: the long prompt below needs many chunks


def _llm(async_scheduling: bool, **options) -> LLM:
    return LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=512, max_num_batched_tokens=BUDGET,
               async_scheduling=async_scheduling, **options)


def _record(engine) -> list:
    """Every step's scheduled (request id, start, new tokens, prompt tokens), in order."""
    steps = []
    engine.on_step = lambda out, seconds: steps.append(
        [(item.seq.request_id, item.start, item.num_new_tokens, item.seq.num_prompt_tokens) for item in out.scheduled])
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_long_prompt_never_starves_the_running_decodes(async_scheduling):
    engine = _llm(async_scheduling).engine
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"short-{i}", [5 + i, 6, 7, 8], greedy)
    tokens = {f"short-{i}": 0 for i in range(4)}
    while min(tokens.values()) < 2:  # until every short request is decoding
        for output in engine.step():
            tokens[output.request_id] = len(output.outputs[0].token_ids)
    steps = _record(engine)
    long_prompt = torch.randint(3, 500, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id in tokens:
                tokens[output.request_id] = len(output.outputs[0].token_ids)
    prefill_steps = [step for step in steps if any(rid == "long" and start + new <= 96 for rid, start, new, _ in step)]
    assert len(prefill_steps) >= 96 // BUDGET  # the prompt was chunked over many steps
    for step in prefill_steps:
        decodes = {rid for rid, _, new, prompt_len in step if rid.startswith("short") and new == 1}
        assert decodes == set(tokens)  # every running decode got its token in every step of the prefill
        assert sum(new for _, _, new, _ in step) <= BUDGET
    assert all(count == 16 for count in tokens.values())
    assert engine.stats().num_used_blocks == 0
    engine.check_integrity()


class _LetterTokenizer:
    """Token id -> one letter: enough of a tokenizer for stop strings on a random-weight model."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + token % 26) for token in ids)

    def __call__(self, text):
        return {"input_ids": [ord(c) - ord("a") for c in text]}


def test_under_async_scheduling_stop_strings_keep_the_overlap_and_cost_at_most_one_token():
    prompts = [[4, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16]]
    free = _llm(False, tokenizer=_LetterTokenizer()).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # Each request stops on the text of its tokens 4..5: it ends there, well before max_tokens.
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[o.outputs[0].text[4:6]])
              for o in free]
    computed, results, overlapped = {}, {}, {}
    for async_scheduling in (False, True):
        llm = _llm(async_scheduling, tokenizer=_LetterTokenizer())
        steps = _record(llm.engine)
        engine, in_flight = llm.engine, []
        step = engine.step

        def watched_step(step=step, engine=engine, in_flight=in_flight):
            outputs = step()
            in_flight.append(engine._in_flight is not None)  # a step left running on the device: overlap
            return outputs

        engine.step = watched_step
        outputs = llm.generate(prompts, params)
        overlapped[async_scheduling] = sum(in_flight)
        results[async_scheduling] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
        computed[async_scheduling] = {}
        for scheduled in steps:
            for request_id, _, new, _ in scheduled:
                computed[async_scheduling][request_id] = computed[async_scheduling].get(request_id, 0) + new
        assert llm.stats()["num_used_blocks"] == 0
        llm.engine.check_integrity()
    assert overlapped[False] == 0 and overlapped[True] >= 4  # requests with stop strings still overlap steps
    assert all(reason == "stop" for _, reason in results[False])
    assert results[True] == results[False]  # the token past the stop string was dropped, never reported
    for request_id, tokens in computed[False].items():
        assert tokens <= computed[True][request_id] <= tokens + 1
