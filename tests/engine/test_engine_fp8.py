"""FP8 KV through the engine and the drop-in cache on CPU: sizing, scales, determinism, both model paths.

The tiny random models run in fp32, so an FP8 pool holds 4x the blocks of the same budget.
Preemption (recompute and swap) and prefix caching with FP8 are `test_engine.py`'s own tests,
parametrized over kv_cache_dtype: they must not change a single token, because the scales are
fixed at startup, so a recomputed, swapped or shared block holds the bytes first written.
"""

import logging

import pytest
import torch

from helpers import tiny
from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.hf import PagedCache, PagePool
from pagedkv.hf.cache import calibrate_kv_scales
from pagedkv.hf.kv_scales import calibration_token_ids, checkpoint_kv_scales

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts(count, vocab=500, seed=0, lengths=(5, 17, 1, 33, 8, 16, 24)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(count)]


def _llm(name="tiny-llama", **options):
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 512)
    options.setdefault("kv_cache_dtype", "fp8_e4m3")
    return LLM(hf_model=tiny(name), **options)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_fp8_pool_holds_more_blocks_and_says_so(caplog):
    budget = 2 * 2**20
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        fp8 = LLM(hf_model=tiny("tiny-llama"), kv_cache_memory=budget, kv_cache_dtype="fp8_e4m3").engine
    auto = LLM(hf_model=tiny("tiny-llama"), kv_cache_memory=budget).engine
    assert fp8.pool.dtype == torch.float8_e4m3fn and auto.pool.dtype == torch.float32
    # One byte per value against fp32's four: the same budget holds 4x the blocks.
    assert fp8.pool.bytes_per_block * 4 == auto.pool.bytes_per_block
    assert fp8.scheduler.block_manager.num_blocks == budget // fp8.pool.bytes_per_block
    assert fp8.scheduler.block_manager.num_blocks >= 4 * auto.scheduler.block_manager.num_blocks - 3
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool"))
    assert "KV dtype fp8_e4m3" in line and "calibration" in line
    assert fp8.pool.k_scale.shape == (2, 2) and fp8.pool.scales_source.startswith("calibration")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_output_is_deterministic_and_scales_stay_fixed(kv_cache_dtype):
    prompts = _prompts(5)
    first = _llm(kv_cache_dtype=kv_cache_dtype)
    scales = first.engine.pool.k_scale.clone(), first.engine.pool.v_scale.clone()
    outputs = first.generate(prompts, GREEDY)
    assert torch.equal(first.engine.pool.k_scale, scales[0]) and torch.equal(first.engine.pool.v_scale, scales[1])
    second = _llm(kv_cache_dtype=kv_cache_dtype)
    assert torch.equal(second.engine.pool.k_scale, scales[0])
    assert _tokens(second.generate(prompts, GREEDY)) == _tokens(outputs)
    assert first.stats()["num_used_blocks"] == 0


def test_fp8_swap_space_holds_fp8_blocks():
    """The host pool (swap space) stores the pool's raw FP8 bytes, one per value (scales unchanged);
    preemption itself is covered by test_engine.py's preemption and prefix-cache tests, parametrized
    over kv_cache_dtype."""
    llm = _llm(num_blocks=24, preemption_mode="swap", swap_space=16 * 2**10)
    host = llm.engine.runner.offload.host
    bytes_per_block = llm.engine.pool.bytes_per_block
    assert host.dtype == torch.uint8 and host.shape[0] == 16 * 2**10 // bytes_per_block
    assert host[0].numel() == bytes_per_block


def test_fp8_own_decoder_and_hf_modules_agree():
    prompts = _prompts(4, seed=5)
    own = _llm("tiny-llama", model_impl="pagedkv")
    hf = _llm("tiny-llama", model_impl="hf")
    assert own.engine.model_impl == "pagedkv" and hf.engine.model_impl == "hf"
    assert _tokens(own.generate(prompts, GREEDY)) == _tokens(hf.generate(prompts, GREEDY))


def test_fp8_drop_in_cache_matches_the_engine():
    """`PagedCache` over an FP8 `PagePool` calibrates the same scales and generates the engine's tokens."""
    model = tiny("tiny-llama")
    pool = PagePool.for_model(model, num_blocks=64, block_size=4, kv_cache_dtype="fp8_e4m3")
    engine_pool = _llm().engine.pool
    assert torch.equal(pool.kv.k_scale, engine_pool.k_scale) and torch.equal(pool.kv.v_scale, engine_pool.v_scale)
    prompt = _prompts(1, lengths=(13,))[0]
    with PagedCache(pool) as cache:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=16,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == _tokens(_llm().generate([prompt], GREEDY))[0]
    pool.check_integrity()
    assert pool.num_used_blocks == 0


def test_checkpoint_scales_win_over_calibration(tmp_path):
    """vLLM-style k_scale/v_scale on the attention modules, or in a checkpoint's safetensors, are used as given."""
    model = tiny("tiny-qwen2")
    layers = model.model.layers
    assert checkpoint_kv_scales(model) is None
    try:
        for i, layer in enumerate(layers):
            layer.self_attn.k_scale = torch.tensor(0.01 * (i + 1))
            layer.self_attn.v_scale = torch.tensor([0.002, 0.003])  # per KV head
        engine = _llm("tiny-qwen2").engine
        assert engine.pool.scales_source.startswith("checkpoint")
        assert torch.allclose(engine.pool.k_scale, torch.tensor([[0.01, 0.01], [0.02, 0.02]]))
        assert torch.equal(engine.pool.v_scale[1], torch.tensor([0.002, 0.003]))
        layers[1].self_attn.k_scale = None  # half a set is refused, not mixed with calibration
        with pytest.raises(ConfigError, match="layer 1"):
            checkpoint_kv_scales(model)
    finally:
        for layer in layers:
            layer.self_attn.k_scale = layer.self_attn.v_scale = None
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.k_proj.output_scale": torch.tensor([0.5]),
               "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.kv_scale": torch.tensor(0.125)}, str(tmp_path / "scales.safetensors"))
    scales = checkpoint_kv_scales(model, tmp_path)
    assert scales.k_scale.tolist() == [[0.5, 0.5], [0.125, 0.125]] and scales.v_scale[0].tolist() == [0.25, 0.25]


def test_calibration_maps_the_amax_below_the_format_max():
    model = tiny("tiny-llama")
    ids = calibration_token_ids(None, model.config.vocab_size)
    scales = calibrate_kv_scales(model, ids, torch.float8_e4m3fn)
    assert len(ids) > 300 and scales.source.startswith(f"calibration: {min(len(ids), 512)} tokens")
    # Rerun the text into a bf16-free fp32 pool and check the stored K fits in half the range (headroom 2).
    pool = PagePool.for_model(model, num_blocks=200, block_size=4)
    with PagedCache(pool) as cache:
        model(input_ids=torch.tensor([ids[:512]]), past_key_values=cache, use_cache=True)
        k_amax = pool.kv.kv[0].abs().amax(dim=(1, 2, 4))  # [L, Hkv]
    assert torch.allclose(k_amax / scales.k_scale, torch.full_like(k_amax, 224.0), rtol=1e-5)


def test_bad_kv_cache_dtype_is_refused_before_loading():
    with pytest.raises(ConfigError, match=r"'fp16'.*auto, fp8_e4m3, fp8_e5m2"):
        LLM(hf_model=tiny("tiny-llama"), kv_cache_dtype="fp16")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        PagePool.for_model(tiny("tiny-llama"), num_blocks=4, kv_cache_dtype="e4m3")


def test_generate_and_serve_take_kv_cache_dtype(monkeypatch, capsys):
    from server_helpers import tiny_chat_model

    import pagedkv.engine.llm as llm_module
    from pagedkv.cli import main
    from pagedkv.server.cli import build_parser, engine_config

    model, tokenizer = tiny_chat_model()
    real_llm, engines = llm_module.LLM, []

    def tiny_llm(name, **options):
        llm = real_llm(hf_model=model, tokenizer=tokenizer, **options)
        engines.append(llm.engine)
        return llm

    monkeypatch.setattr(llm_module, "LLM", tiny_llm)
    import transformers

    verbosity = transformers.logging.get_verbosity()
    try:
        assert main(["generate", "--kv-cache-dtype", "fp8_e5m2", "--max-tokens", "3", "--kv-cache-memory", "8MiB",
                     "--json", "Hello"]) == 0
    finally:  # generate quiets transformers for the process
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
    assert engines[0].pool.dtype == torch.float8_e5m2 and "completions" in capsys.readouterr().out
    assert engine_config(build_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3"])).kv_cache_dtype == "fp8_e4m3"


def test_fp8_drop_in_cache_forks_rows_for_beam_search():
    """Beam search forks block tables and copies shared blocks on write: the copies move FP8 bytes (uint8 views)."""
    model = tiny("tiny-llama")
    pool = PagePool.for_model(model, num_blocks=128, block_size=4, kv_cache_dtype="fp8_e4m3")
    ids = torch.tensor([_prompts(1, lengths=(10,))[0]])
    with PagedCache(pool) as cache:
        beams = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                               num_beams=3, num_return_sequences=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert beams.shape == (3, 18) and torch.equal(beams[:, :10], ids.expand(3, -1))
    with PagedCache(pool) as cache:
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    assert greedy[0, 10:].tolist() == _tokens(_llm().generate([ids[0].tolist()], GREEDY))[0][:8]
    pool.check_integrity()
    assert pool.num_used_blocks == 0


def test_a_gpu_too_old_for_the_format_is_refused(monkeypatch):
    from pagedkv.kernels.fp8 import resolve_kv_cache_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ConfigError, match=r"'fp8_e4m3' needs .* 8\.9\+.*8\.0; choose one of auto, fp8_e5m2"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ConfigError, match="choose one of auto$"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, "cuda")
