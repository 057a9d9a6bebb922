"""Gemma 3, Gemma 2, Phi-3 and GPT-2 on pagedkv's own decoder against HF's modules (CPU; CUDA: `gpu`).

Tiny fp32 configs of the real architectures with 8-token windows (tiny-gemma3: two sliding layers
and a global one, each with its own rotary base; tiny-gemma2: soft caps small enough to bite;
tiny-phi3: longrope, every layer sliding), so prompts and generations run well past the window.
HF's eager attention is the oracle (its sdpa path has no soft cap). The same families run on CUDA
with and without graphs in `test_models.test_engine_on_cuda_equals_hf_generate_fp32`.
"""

import pytest
import torch
from transformers import AutoConfig

from helpers import hf_greedy, max_logit_error_vs_hf, own_prefill_logits, tiny
from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.models import DecoderConfig, build_own_model
from pagedkv.models.config import attention_shape
from pagedkv.models.loader import RANDOM_CONFIGS

FAMILIES = ["tiny-gemma3", "tiny-gemma2", "tiny-phi3", "tiny-gpt2"]
WINDOW = 8


@pytest.mark.parametrize("name", FAMILIES)
def test_own_decoder_logits_match_hf(name):
    """Prompts shorter than, and three times, the window."""
    assert max_logit_error_vs_hf(tiny(name), (7, 3 * WINDOW + 1, 1), attn="eager") <= 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_equals_hf_generate_past_the_window(name):
    """Chunked prefills (16-token budget), decode and mixed steps, sequences up to 4.6x the window."""
    model = tiny(name)
    llm = LLM(hf_model=model, block_size=4, num_blocks=128, model_impl="pagedkv", max_num_batched_tokens=16,
              device="cpu")
    assert llm.engine.model_impl == "pagedkv"
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 21, 9)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 16, attn="eager") for p in prompts]
    assert llm.stats()["num_used_blocks"] == 0


def test_config_reader_gives_each_family_its_fields():
    gemma3 = DecoderConfig.from_hf(tiny("tiny-gemma3").config)
    assert gemma3.sliding_windows == (WINDOW, WINDOW, None) and gemma3.qk_norm and gemma3.family == "gemma"
    assert gemma3.scale == 16 ** -0.5 and gemma3.attn_soft_cap is None and gemma3.final_soft_cap is None
    gemma2 = DecoderConfig.from_hf(tiny("tiny-gemma2").config)
    assert (gemma2.attn_soft_cap, gemma2.final_soft_cap, gemma2.sliding_windows) == (0.5, 0.3, (WINDOW, None))
    assert DecoderConfig.from_hf(tiny("tiny-phi3").config).sliding_windows == (WINDOW, WINDOW)
    gpt2 = DecoderConfig.from_hf(tiny("tiny-gpt2").config)
    assert (gpt2.family, gpt2.hidden_act, gpt2.intermediate_size) == ("gpt2", "gelu_new", 256)
    # The real shapes: Gemma 3's 5 local : 1 global, its 512-token window.
    shape = attention_shape(AutoConfig.for_model(**RANDOM_CONFIGS["gemma3-1b"]))
    assert shape.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",) and shape.sliding_window == 512


@pytest.mark.parametrize("overrides, match", [
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
    ({"model_type": "gemma2", "hidden_activation": "relu"}, "relu"),
    ({"model_type": "phi3", "rope_scaling": None, "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
])
def test_uncovered_variants_are_typed_errors(overrides, match):
    base = {"gemma3_text": "tiny-gemma3", "gemma2": "tiny-gemma2", "phi3": "tiny-phi3"}[overrides["model_type"]]
    config = AutoConfig.for_model(**{**RANDOM_CONFIGS[base], **overrides})
    with pytest.raises(ConfigError, match=match):
        DecoderConfig.from_hf(config)


def test_tensor_parallel_gpt2_is_a_typed_error():
    class FakeGroup:
        size, rank, device = 2, 0, torch.device("cpu")

    with pytest.raises(ConfigError, match="GPT-2"):
        build_own_model(tiny("tiny-gpt2"), tp=FakeGroup())


def test_longrope_table_switches_to_the_long_factors_where_hf_does():
    """Rows below original_max_position_embeddings use the short factors, rows from it on the long ones."""
    model = tiny("tiny-phi3")
    own = build_own_model(model, max_positions=256)
    rotary = model.model.rotary_emb
    switch = model.config.original_max_position_embeddings
    x = torch.zeros(1, 1, 16)
    for position in (0, switch - 1, switch, 200):
        # HF's rotary for a sequence ending at `position` (it picks short or long by that length).
        cos, sin = rotary(x, torch.arange(position + 1)[None])
        torch.testing.assert_close(own.rotary.cos[position], cos[0, -1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(own.rotary.sin[position], sin[0, -1], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(own.rotary.cos[switch - 1], own.rotary.cos[switch])


def test_gemma3_multimodal_checkpoint_runs_its_language_model():
    """A Gemma 3 checkpoint with a vision tower: the own decoder takes its language model (text only)."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    text = {key: value for key, value in RANDOM_CONFIGS["tiny-gemma3"].items() if key != "model_type"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma3Config(text_config=text, vision_config=vision,
                                                          mm_tokens_per_image=4)).eval()
    prompt = list(range(3, 3 + 3 * WINDOW))
    own = own_prefill_logits(model, [prompt])[0]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    assert (own - expected).abs().max().item() <= 1e-4
