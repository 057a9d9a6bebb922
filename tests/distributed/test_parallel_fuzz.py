"""The request fuzz at a smaller count on the parallel engines on CPU: two data-parallel replicas, and
tensor parallelism over gloo. A request's failure stays with it, and every block comes back.

The batch mixes in `n > 1` with `max_tokens = 1` beside ordinary requests: that request once
failed its whole step, and on a replica or a TP group that took its step-mates down with it.
"""

import random

import pytest
from fuzz_requests import FuzzRequest, check_final_output, draw_requests, fail_in_resolve, fuzz_seed, run_batch

from pagedkv import LLM, SamplingParams

REQUESTS = 12


def _requests(rng: random.Random, prefix: str) -> list[FuzzRequest]:
    first_tokens = [FuzzRequest(f"{prefix}-first-{n}", [5, 6, 7, n], SamplingParams(temperature=1.0, n=n,
                                                                                   max_tokens=1))
                    for n in (2, 4)]
    return first_tokens + draw_requests(rng, REQUESTS, prefix)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["data_parallel_size", "tensor_parallel_size"])
def test_fuzz_on_parallel_engines(parallel):
    seed = fuzz_seed() * 1000 + 900 + (parallel == "tensor_parallel_size")
    context = f"{parallel}=2 fuzz seed {seed} (replay: PAGEDKV_FUZZ_SEED={fuzz_seed()})"
    rng = random.Random(seed)
    llm = LLM("random:tiny-llama", device="cpu", block_size=4, num_blocks=48, max_num_seqs=12,
              max_num_batched_tokens=32, **{parallel: 2})
    try:
        requests = _requests(rng, parallel[:2])
        final, aborted = run_batch(llm.engine, requests, rng, context)
        for request in requests:
            if request.params is not None and request.request_id in final:
                check_final_output(request, final[request.request_id], context)
        assert all(r.request_id in final for r in requests[:2] if r.request_id not in aborted), context
        stats = llm.stats()
        assert stats["num_used_blocks"] == 0 and stats["num_request_failures"] == 0, f"{context}: {stats}"
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_a_request_failing_on_rank_0_fails_alone_under_tensor_parallelism(monkeypatch):
    """Resolving happens on rank 0 only: a request that fails there ends alone, and the group goes on in step."""
    llm = LLM("random:tiny-llama", device="cpu", block_size=4, num_blocks=64, tensor_parallel_size=2)
    try:
        engine = llm.engine
        fail_in_resolve(monkeypatch, "doomed", after_tokens=2)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for name, prompt in (("fine", [5, 6, 7]), ("doomed", [8, 9, 10]), ("also-fine", [11, 12])):
            engine.add_request(name, prompt, params)
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: o for o in engine.step() if o.finished})
        assert "injected failure" in final["doomed"].error
        assert all(final[name].error is None and len(final[name].outputs[0].token_ids) == 6
                   for name in ("fine", "also-fine"))
        monkeypatch.undo()
        again = llm.generate([[5, 6, 7]], params)[0]  # the group is still in step
        assert again.outputs[0].token_ids == final["fine"].outputs[0].token_ids
        assert llm.stats()["num_used_blocks"] == 0 and llm.stats()["num_request_failures"] == 1
    finally:
        llm.engine.shutdown()
