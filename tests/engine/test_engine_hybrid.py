"""The engine on sliding-window models: a block table per layer group, sliding groups keeping only their window.

Tiny models with a window of 8 tokens and sequences up to 35 tokens: a tiny Gemma 3 (2 sliding layers to
1 global; own decoder and HF's modules) and a tiny Mistral whose every layer slides (own decoder).
"""

import functools

import pytest

from helpers import assert_preempts_and_matches, hf_greedy, output_token_ids as _tokens, random_prompts
from pagedkv import LLM, SamplingParams
from pagedkv.core.block_manager import KVBlockManager
from pagedkv.core.hybrid_block_manager import HybridBlockManager
from pagedkv.hf import random_model

WINDOW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def model(name: str):
    return random_model(name, sliding_window=WINDOW) if name == "tiny-mistral" else random_model(name)


def _prompts(count, seed=0, lengths=(21, 5, 13, 1)):
    return random_prompts(count, seed=seed, lengths=lengths)


def _llm(name, **options):
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 256)
    return LLM(hf_model=model(name), **options)


@functools.lru_cache(maxsize=None)
def _reference(name: str) -> tuple:
    return tuple(tuple(hf_greedy(model(name), p, GREEDY.max_tokens)) for p in _prompts(4))


@pytest.mark.parametrize("name,model_impl", [("tiny-gemma3", "auto"), ("tiny-gemma3", "hf"), ("tiny-mistral", "auto")])
def test_greedy_equals_hf_generate_past_the_window(name, model_impl):
    """Own decoders (Gemma 3, Mistral) and HF's modules read each layer's group's tables."""
    llm = _llm(name, max_num_batched_tokens=16, model_impl=model_impl)  # chunked prefill of the longest prompt
    assert llm.engine.model_impl == ("hf" if model_impl == "hf" else "pagedkv")
    bm = llm.engine.scheduler.block_manager
    assert type(bm) is HybridBlockManager
    assert [g.sliding_window for g in bm.groups] == ([None, WINDOW, WINDOW] if name == "tiny-gemma3" else [WINDOW])
    outputs = llm.generate(_prompts(4), GREEDY)
    assert _tokens(outputs) == [list(t) for t in _reference(name)]
    assert llm.stats()["num_used_blocks"] == 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("mode,kv_cache_dtype", [("recompute", "auto"), ("swap", "fp8_e4m3")])
def test_preemption_per_group_matches_an_unpreempted_run(mode, kv_cache_dtype):
    """A pool of 32 blocks of 2 layers for 4 sequences of up to 35 tokens: victims are preempted and come back.

    16-bit KV must give HF's tokens; FP8 KV (fixed scales) the tokens of a pool large enough for no preemption.
    """
    prompts = _prompts(4)
    if kv_cache_dtype == "auto":
        expected = [list(t) for t in _reference("tiny-gemma3")]
    else:
        expected = _tokens(_llm("tiny-gemma3", kv_cache_dtype=kv_cache_dtype).generate(prompts, GREEDY))
    small_llm = _llm("tiny-gemma3", num_blocks=32, watermark=0.0, preemption_mode=mode, swap_space=2**20,
                     max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    assert_preempts_and_matches(small_llm, prompts, GREEDY, expected, mode)


def test_prefix_hit_past_the_window_equals_a_miss():
    """A 24-token shared prefix: the second prompt reuses the full group's 6 blocks and the window's blocks."""
    shared = _prompts(1, seed=2, lengths=(24,))[0]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    cold = _llm("tiny-gemma3", enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = _llm("tiny-gemma3")
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts[1:], GREEDY)
    assert second[0].num_cached_tokens == 24
    assert _tokens(first + second) == _tokens(cold)
    llm.engine.check_integrity()


def test_hybrid_kv_off_keeps_one_full_length_table():
    engine = _llm("tiny-gemma3", hybrid_kv=False).engine
    assert type(engine.scheduler.block_manager) is KVBlockManager and engine.pool.num_slots == 3


def test_layer_groups_only_where_a_window_is_shorter_than_the_positions():
    """Phi-3.5-mini's window (262,144) outlasts its positions (131,072): it never slides, so one table."""
    from transformers import AutoConfig

    from pagedkv.core.memory import ModelSpec
    from pagedkv.engine.startup import kv_layout_of
    from pagedkv.models.shapes import MODEL_SHAPES

    spec = ModelSpec(1, 8, 128, 2)
    layouts = {name: kv_layout_of(AutoConfig.for_model(**MODEL_SHAPES[name].config), spec)
               for name in ("phi3.5-mini", "phi3-mini", "gemma3-12b", "llama3-8b")}
    assert layouts["phi3.5-mini"] is None and layouts["llama3-8b"] is None
    assert layouts["phi3-mini"].num_groups == 1 and layouts["phi3-mini"].groups[0].sliding_window == 2047
    assert (layouts["gemma3-12b"].num_groups, layouts["gemma3-12b"].num_slots) == (6, 8)
