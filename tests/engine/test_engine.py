"""The engine on CPU: HF-identical greedy output, preemption, prefix caching, n > 1, aborts, rejection."""

import random

import pytest

from fuzz_requests import random_lifecycles
from helpers import assert_preempts_and_matches, hf_greedy, smollm2, tiny
from helpers import output_token_ids as _tokens, random_prompts as _prompts
from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError, InvalidArgumentError, RequestRejectedError, SamplingParamsError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(name, **options):
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 512)
    return LLM(hf_model=tiny(name), **options)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-mistral", "tiny-qwen2"])
def test_greedy_equals_hf_generate(name):
    llm = _llm(name, max_num_batched_tokens=24)  # forces chunked prefill of the 33-token prompt
    prompts = _prompts(7)
    outputs = llm.generate(prompts, GREEDY)
    assert _tokens(outputs) == [hf_greedy(tiny(name), p, 12) for p in prompts]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.stats()["num_used_blocks"] == 0
    llm.engine.check_integrity()


@pytest.mark.slow
def test_embedded_smollm2_greedy_equals_hf_generate_and_answers():
    model, tokenizer = smollm2()
    llm = LLM(hf_model=model, tokenizer=tokenizer, kv_cache_memory=64 * 2**20)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [llm.apply_chat_template(question), tokenizer("def add(a, b):")["input_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(model, prompt, 16, eos=True)
        assert output.outputs[0].token_ids == expected
    assert "Paris" in outputs[0].outputs[0].text
    chat = llm.chat(question, params)[0]
    assert chat.outputs[0].text.strip() == "The capital of France is Paris."
    assert chat.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_and_matches_a_large_pool(mode, kv_cache_dtype):
    """FP8 too: fixed scales make a recomputed or swapped-in block hold the bytes it held before."""
    prompts = _prompts(8, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    large = _llm("tiny-llama", kv_cache_dtype=kv_cache_dtype).generate(prompts, params)
    small_llm = _llm("tiny-llama", num_blocks=24, watermark=0.0, preemption_mode=mode, swap_space=64 * 2**10,
                     max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    assert_preempts_and_matches(small_llm, prompts, params, _tokens(large), mode)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prefix_cache_hit_equals_miss(kv_cache_dtype):
    shared = _prompts(1, lengths=(40,))[0]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    cold = _llm("tiny-qwen3", enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype).generate(prompts, GREEDY)
    llm = _llm("tiny-qwen3", kv_cache_dtype=kv_cache_dtype)
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts[1:], GREEDY)
    assert second[0].num_cached_tokens == 40  # 10 full blocks of 4 shared
    assert llm.stats()["prefix_cache_hit_tokens"] == 40
    assert _tokens(first + second) == _tokens(cold)


def test_parallel_sampling_shares_the_prompt_blocks():
    llm = _llm("tiny-llama", num_blocks=64)
    prompt = _prompts(1, lengths=(30,))[0]  # 7 full blocks + 2 tokens
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    engine.step()  # prefill and the first samples; the request forks into 4 sequences
    seqs = engine.requests["r"].seqs
    assert len(seqs) == 4
    bm = engine.scheduler.block_manager
    tables = [bm.block_ids(s.seq_id) for s in seqs]
    assert all(t[:7] == tables[0][:7] for t in tables)  # full prompt blocks shared
    assert len({b for t in tables for b in t}) < 4 * len(tables[0])
    while engine.has_unfinished_requests():
        outputs = engine.step()
    final = outputs[0]
    assert final.finished and len(final.outputs) == 4
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # independent samples
    assert bm.num_used_blocks == 0
    engine.check_integrity()


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    prompt = _prompts(1)[0]
    alone = _llm("tiny-llama").generate([prompt], params)
    batched = _llm("tiny-llama").generate([prompt] + _prompts(5, seed=9), [params] + [GREEDY] * 5)
    assert _tokens(alone)[0] == _tokens(batched)[0]


def test_abort_mid_prefill_and_mid_decode_returns_blocks():
    llm = _llm("tiny-llama", max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("long", _prompts(1, lengths=(40,))[0], GREEDY)
    engine.add_request("short", [5, 6, 7], GREEDY)
    engine.step()
    long_seq = engine.requests["long"].seqs[0]
    assert 0 < long_seq.num_computed_tokens < long_seq.num_prompt_tokens  # mid-prefill
    assert engine.abort("long")
    for _ in range(3):
        engine.step()
    assert engine.requests["short"].seqs[0].num_output_tokens > 0  # mid-decode
    assert engine.abort("short")
    assert not engine.abort("short")
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_never_fit_is_rejected_while_others_finish():
    llm = _llm("tiny-llama", num_blocks=16)  # 64 tokens
    prompts = [_prompts(1, lengths=(10,))[0], _prompts(1, lengths=(60,))[0], [4, 5]]
    outputs = llm.generate(prompts, GREEDY)
    assert outputs[1].outputs[0].finish_reason == "rejected"
    assert "64" in outputs[1].error and "72" in outputs[1].error
    assert [o.outputs[0].finish_reason for o in (outputs[0], outputs[2])] == ["length", "length"]
    with pytest.raises(RequestRejectedError):
        llm.engine.add_request("x", list(range(3, 70)), GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_stop_token_ids_and_stop_strings():
    llm = _llm("tiny-llama")
    prompt = _prompts(1)[0]
    free = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_id = free[3]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id],
                                                    ignore_eos=True))[0].outputs[0]
    assert stopped.token_ids == free[:free.index(stop_id) + 1] and stopped.finish_reason == "stop"


def test_stop_strings_on_the_real_tokenizer():
    model, tokenizer = smollm2()
    llm = LLM(hf_model=model, tokenizer=tokenizer, kv_cache_memory=32 * 2**20)
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[" is"]))[0].outputs[0]
    assert out.text == "The capital of France" and out.finish_reason == "stop"
    assert llm.stats()["num_used_blocks"] == 0


def test_thousand_random_lifecycles_with_aborts_end_clean():
    rng = random.Random(7)
    llm = _llm("tiny-llama", num_blocks=20, watermark=0.05, max_num_batched_tokens=32, max_num_seqs=16)
    random_lifecycles(llm.engine, rng, 1000, lambda r: [r.randint(3, 499) for _ in range(r.randint(1, 20))], 12)
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("max_tokens", 0), ("n", 0),
    ("seed", "x"), ("stop", [""]), ("stop_token_ids", [-1]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_bad_engine_input():
    with pytest.raises(ConfigError, match="largest model length that fits is 64"):
        _llm("tiny-llama", num_blocks=16, max_model_len=100)
    llm = _llm("tiny-llama")
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        llm.generate([[1, 2, 99999]])
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"])
    assert not llm.engine.has_unfinished_requests()


def test_parallel_sampling_respects_max_num_seqs():
    llm = _llm("tiny-llama", max_num_seqs=2)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], [8, 9, 10]], params)
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 5 for c in o.outputs) for o in outputs)
    rejected = llm.generate([[5, 6, 7]], SamplingParams(n=3, max_tokens=2))[0]
    assert rejected.outputs[0].finish_reason == "rejected" and "max_num_seqs is 2" in rejected.error
    llm.engine.check_integrity()


def test_forked_sequence_swapped_out_with_the_whole_pool_comes_back():
    llm = _llm("tiny-llama", num_blocks=4, max_model_len=16, preemption_mode="swap", swap_space=2**20,
               watermark=0.0)
    out = llm.generate([list(range(3, 16))], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=3,
                                                            ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
    assert llm.stats()["num_used_blocks"] == 0


def test_seeded_parallel_samples_are_reproducible_and_distinct():
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    llm = _llm("tiny-llama")
    first = llm.generate([[4, 5, 6]], params)[0]
    second = llm.generate([[4, 5, 6]], params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    # The sampler keeps no per-sequence state: streams are a function of (seed, sample index, position).
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_prompt_tokens_are_counted_once_with_parallel_sampling():
    llm = _llm("tiny-llama")
    llm.generate([list(range(3, 13))], SamplingParams(n=4, temperature=1.0, max_tokens=2, ignore_eos=True))
    assert llm.stats()["num_prompt_tokens"] == 10


def test_bad_priorities_queue_nothing():
    llm = _llm("tiny-llama")
    with pytest.raises(InvalidArgumentError, match="1 priorities for 2 prompts"):
        llm.generate([[3, 4], [5, 6]], GREEDY, priorities=[1])
    assert not llm.engine.has_unfinished_requests()


def test_stop_string_completed_by_the_last_token_reports_stop():
    model, tokenizer = smollm2()
    llm = LLM(hf_model=model, tokenizer=tokenizer, kv_cache_memory=32 * 2**20)
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    stop = full.text[-5:]
    assert full.text.find(stop) == len(full.text) - 5  # the stop string first appears at the very end
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:-5]


def test_logprobs_come_back_per_token_and_per_sample():
    llm = _llm("tiny-llama")
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=3)
    out = llm.generate([[4, 5, 6, 7]], params)[0]
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert entry.token_id == token and entry.logprob <= 0.0
            assert len(entry.top) == 3 and entry.top[0][1] >= entry.top[-1][1]
    greedy = llm.generate([[4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert greedy.outputs[0].logprobs is None


def test_min_tokens_holds_back_eos():
    model = tiny("tiny-llama")
    eos = model.generation_config.eos_token_id
    llm = _llm("tiny-llama")
    # A logit bias makes EOS the greedy choice; min_tokens must still produce 5 tokens first.
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=5, logit_bias={eos: 100.0})
    out = llm.generate([[4, 5, 6]], params)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_equals_sync_under_preemption_eos_and_stop(mode):
    """Step k+1 scheduled before step k's tokens are known: the same tokens, reasons and clean pools."""
    model = tiny("tiny-llama")
    eos = model.generation_config.eos_token_id
    prompts = _prompts(10, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + i, ignore_eos=i % 3 == 0, stop_token_ids=(17,) * (i % 2))
              for i in range(10)]
    results = {}
    for async_scheduling in (False, True):
        llm = _llm("tiny-llama", num_blocks=30, watermark=0.0, preemption_mode=mode, swap_space=64 * 2**10,
                   max_num_batched_tokens=32, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params)
        results[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_used_blocks"] == 0
        llm.engine.check_integrity()
    assert results[True] == results[False]
    assert all(-1 not in tokens for tokens, _ in results[True])
    assert eos is not None


def test_async_scheduling_aborts_mid_flight_leave_nothing_behind():
    llm = _llm("tiny-qwen3", num_blocks=64, watermark=0.0)
    engine = llm.engine
    rng = random.Random(3)
    live = []
    for step in range(200):
        if rng.random() < 0.5:
            request_id = f"r{step}"
            engine.add_request(request_id, _prompts(1, seed=step)[0], SamplingParams(max_tokens=rng.randint(1, 30)))
            live.append(request_id)
        if live and rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
        for output in engine.step():
            assert all(-1 not in c.token_ids for c in output.outputs)
            if output.finished:
                live.remove(output.request_id)
        engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # a step in flight with only aborted sequences resolves to nothing
    assert llm.stats()["num_used_blocks"] == 0
    engine.check_integrity()
