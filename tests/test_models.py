"""pagedkv's own Llama-family decoder against HF's modules: logits, paths, and the engine on both."""

import pytest
import torch

from helpers import hf_greedy, tiny
from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.kernels import KVPool
from pagedkv.kernels.backend import AttentionBackend
from pagedkv.models import DecoderConfig, LlamaFamilyModel, is_supported

FAMILIES = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral"]


def _own_logits(hf_model, prompts: list[list[int]], block_size: int = 4) -> list[torch.Tensor]:
    """Run the own decoder over `prompts` as one flat prefill step through the paged backend."""
    own = LlamaFamilyModel.from_hf(hf_model)
    cfg = own.cfg
    num_blocks = 64
    pool = KVPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    backend = AttentionBackend(pool, max_num_seqs=len(prompts), max_blocks_per_seq=16, num_table_rows=len(prompts),
                               max_model_len=64)
    ids, positions, slots, lens = [], [], [], []
    next_block = 0
    for row, prompt in enumerate(prompts):
        blocks = list(range(next_block, next_block + -(-len(prompt) // block_size)))
        next_block += len(blocks)
        backend.table_rows[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        ids += prompt
        positions += range(len(prompt))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(len(prompt))]
        lens.append(len(prompt))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    meta = backend.prepare(torch.tensor(slots), torch.arange(len(prompts)), torch.tensor(lens), cu, num_decode=0,
                           host_seq_lens=lens, host_query_lens=lens)
    logits = own(torch.tensor(ids), torch.tensor(positions), backend.bind(meta))
    return list(logits.split(lens))


@pytest.mark.parametrize("name", FAMILIES)
def test_own_decoder_logits_match_hf(name):
    model = tiny(name)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (7, 13, 1)]
    own = _own_logits(model, prompts)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        for prompt, logits in zip(prompts, own):
            with torch.no_grad():
                expected = model(torch.tensor([prompt])).logits[0]
            assert (logits - expected).abs().max().item() <= 1e-4
    finally:
        model.set_attn_implementation(previous)


def test_own_decoder_refuses_other_families():
    assert not is_supported(tiny("tiny-gpt2").config)
    with pytest.raises(ConfigError, match="gpt2"):
        DecoderConfig.from_hf(tiny("tiny-gpt2").config)


@pytest.mark.parametrize("impl", ["pagedkv", "hf"])
def test_engine_paths_equal_hf_generate(impl):
    llm = LLM(hf_model=tiny("tiny-qwen3"), block_size=4, num_blocks=256, model_impl=impl, max_num_batched_tokens=16,
              device="cpu")
    assert llm.engine.model_impl == impl
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 21, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(tiny("tiny-qwen3"), p, 10) for p in prompts]
    assert llm.stats()["num_used_blocks"] == 0


def test_model_impl_pagedkv_on_an_uncovered_family_is_a_clear_error():
    with pytest.raises(ConfigError, match="not covered"):
        LLM(hf_model=tiny("tiny-gpt2"), block_size=4, num_blocks=64, model_impl="pagedkv", device="cpu")
