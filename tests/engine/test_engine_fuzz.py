"""Fuzz of the engine's request space (see fuzz_requests.py), and request isolation inside a step.

Each batch runs a few dozen concurrent requests through an engine with a tiny pool (so that
preemption by recompute or by swap happens), with prefix caching and async scheduling on or
off, aborting requests at random steps. After every step the block accounting must hold; after
every batch every block is back; each request ends with a valid finish reason or was refused at
`add_request`; seeded requests give the same tokens alone as in the batch.
"""

import random

import pytest

from fuzz_requests import check_final_output, draw_requests, fail_in_resolve, fuzz_seed, letters_tokenizer, run_batch
from helpers import tiny
from pagedkv import LLM, SamplingParams
from pagedkv.errors import PagedKVError, StepFailedError

NUM_BATCHES = 10
REQUESTS_PER_BATCH = 30


def _engine(rng: random.Random):
    options = dict(
        block_size=4, num_blocks=rng.choice([40, 64, 128]), max_num_seqs=rng.choice([12, 32]),
        max_num_batched_tokens=rng.choice([24, 64]), watermark=0.0,
        preemption_mode=rng.choice(["recompute", "swap"]), swap_space=2**20,
        enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.5,
    )
    return LLM(hf_model=tiny("tiny-llama"), tokenizer=letters_tokenizer(), **options).engine, options


@pytest.mark.parametrize("batch", range(NUM_BATCHES))
def test_fuzz_the_request_space(batch):
    seed = fuzz_seed() * 1000 + batch
    context = f"fuzz seed {seed} (replay: PAGEDKV_FUZZ_SEED={fuzz_seed()} and this batch, {batch})"
    rng = random.Random(seed)
    engine, options = _engine(rng)
    context += f", engine {options}"
    requests = draw_requests(rng, REQUESTS_PER_BATCH, f"b{batch}")
    final, aborted = run_batch(engine, requests, rng, context)
    for request in requests:
        if request.params is None or request.request_id in aborted:
            continue
        if request.request_id not in final:  # refused at add_request (never fits, n > max_num_seqs)
            with pytest.raises(PagedKVError):
                engine.scheduler.check_fits(len(request.prompt), request.params.max_tokens, request.params.n)
            continue
        check_final_output(request, final[request.request_id], context)
    assert engine.scheduler.block_manager.num_used_blocks == 0, f"{context}: blocks left in use"
    assert engine.stats().num_request_failures == 0, context
    # A seeded request's tokens are a function of its seed alone: the same when it runs by itself.
    seeded = [r for r in requests if r.request_id in final and r.params.seed is not None][:2]
    for request in seeded:
        engine.add_request(request.request_id + "-alone", request.prompt, request.params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        got = sorted((c.index, c.token_ids) for c in outputs[0].outputs)
        want = sorted((c.index, c.token_ids) for c in final[request.request_id].outputs)
        assert got == want, f"{context}: seeded request {request.request_id} differs alone: {got} != {want}"
    engine.check_integrity()


def test_n_samples_with_one_token_fork_from_a_finished_parent():
    """The parent finishes by length on its first token; its n - 1 children fork from it all the same.

    Before the fork handled a finished parent, this raised KeyError inside `step()` and failed
    every request of the step.
    """
    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64)
    neighbour = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for n in (2, 3, 8):
        outputs = llm.generate([[5, 6, 7, 8], [9, 10, 11]],
                               [SamplingParams(temperature=1.0, max_tokens=1, n=n, seed=n), neighbour])
        first, other = outputs
        assert [c.index for c in first.outputs] == list(range(n))
        assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in first.outputs)
        assert len(other.outputs[0].token_ids) == 6 and other.outputs[0].finish_reason == "length"
        llm.engine.check_integrity()
    assert llm.stats()["num_used_blocks"] == 0


def test_samples_ending_on_their_first_token_keep_distinct_indices():
    """Children that stop at once (a stop id every token matches) must not reuse a sample index."""
    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64)
    everything = list(range(3, 512))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, n=5, max_tokens=8, seed=3,
                                                   stop_token_ids=everything))[0]
    assert sorted(c.index for c in out.outputs) == list(range(5))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in out.outputs)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, n=4, max_tokens=8, seed=3, min_tokens=2,
                                                   stop_token_ids=everything))[0]
    assert sorted(c.index for c in out.outputs) == list(range(4))
    assert all(len(c.token_ids) == 3 for c in out.outputs), "min_tokens holds stop ids back for every sample"
    assert llm.stats()["num_used_blocks"] == 0


def test_a_request_failing_in_resolve_leaves_its_step_mates_tokens_unchanged(monkeypatch):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5, n=2),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=9)]
    reference = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64).generate(prompts, params)

    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64)
    engine = llm.engine
    fail_in_resolve(monkeypatch, "doomed", after_tokens=3)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    engine.add_request("doomed", [30, 31, 32], SamplingParams(temperature=0.0, max_tokens=8, n=3, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        engine.check_integrity()
    doomed = final["doomed"]
    assert "injected failure" in doomed.error and all(c.finish_reason == "error" for c in doomed.outputs)
    for i, want in enumerate(reference):
        got = final[f"r{i}"]
        assert got.error is None
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert engine.stats().num_request_failures == 1
    assert engine.stats().num_used_blocks == 0


def test_a_request_failing_in_detokenization_ends_alone(monkeypatch):
    tokenizer = letters_tokenizer()
    llm = LLM(hf_model=tiny("tiny-llama"), tokenizer=tokenizer, block_size=4, num_blocks=64)
    engine = llm.engine
    engine.add_request("fine", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("doomed", [8, 9, 10], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    original = engine.output_processor.text

    def text(request, seq):
        if request.request_id == "doomed":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(request, seq)

    monkeypatch.setattr(engine.output_processor, "text", text)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["doomed"].error and final["doomed"].outputs[0].finish_reason == "error"
    assert final["fine"].error is None and len(final["fine"].outputs[0].token_ids) == 6
    assert engine.stats().num_request_failures == 1 and engine.stats().num_used_blocks == 0
    engine.check_integrity()


def test_a_failed_forward_pass_fails_its_step_alone(monkeypatch):
    """A forward pass that raises fails the requests of that step; a request queued behind them goes on."""
    llm = LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64, max_num_seqs=2, async_scheduling=False)
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"in-step-{i}", [5 + i, 6, 7], SamplingParams(temperature=0.0, max_tokens=4,
                                                                        ignore_eos=True))
    engine.add_request("queued", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    original = engine.runner.execute
    calls = []

    def execute(step_input, previous_tokens):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected device failure")
        return original(step_input, previous_tokens)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.step()
    with pytest.raises(StepFailedError) as info:
        engine.step()
    assert sorted(info.value.request_ids) == ["in-step-0", "in-step-1"]
    engine.check_integrity()
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(final) == ["queued"] and len(final["queued"].outputs[0].token_ids) == 4
    assert engine.stats().num_used_blocks == 0
