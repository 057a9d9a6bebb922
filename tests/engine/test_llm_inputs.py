"""`LLM.generate` takes prompts in every form vLLM users pass: token-id tuples, arrays, tensors, dicts."""

import numpy as np
import pytest
import torch
from helpers import tiny

from pagedkv import LLM, SamplingParams
from pagedkv.errors import InvalidArgumentError

PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(hf_model=tiny("tiny-llama"), block_size=4, num_blocks=64)


@pytest.fixture(scope="module")
def expected(llm):
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("make_one", [
    tuple,
    lambda ids: np.array(ids, dtype=np.int64),
    lambda ids: np.array(ids, dtype=np.int32),
    lambda ids: torch.tensor(ids),
    lambda ids: {"prompt_token_ids": ids},
    lambda ids: {"prompt_token_ids": torch.tensor(ids)},
    lambda ids: [np.int64(t) for t in ids],
], ids=["tuple", "int64 array", "int32 array", "tensor", "dict", "dict of tensor", "numpy ints"])
def test_one_prompt_in_any_form(llm, expected, make_one):
    outputs = llm.generate(make_one(PROMPTS[0]), GREEDY)
    assert len(outputs) == 1  # one prompt, not three one-token prompts
    assert _tokens(outputs) == expected[:1]
    assert outputs[0].prompt_token_ids == PROMPTS[0]


@pytest.mark.parametrize("make_batch", [
    lambda prompts: [tuple(p) for p in prompts],
    lambda prompts: [{"prompt_token_ids": p} for p in prompts],
    lambda prompts: [np.array(p) for p in prompts],
    lambda prompts: (torch.tensor(p) for p in prompts),
], ids=["tuples", "dicts", "arrays", "generator of tensors"])
def test_a_batch_in_any_form(llm, expected, make_batch):
    assert _tokens(llm.generate(make_batch(PROMPTS), GREEDY)) == expected


def test_a_2d_array_is_a_batch_of_rows(llm):
    rows = np.array([[5, 6, 7], [9, 10, 11]])
    by_rows = _tokens(llm.generate(rows, GREEDY))
    assert by_rows == _tokens(llm.generate([[5, 6, 7], [9, 10, 11]], GREEDY))


@pytest.mark.parametrize("prompt, message", [
    ((5.0, 6.0), "must be ints"),
    (torch.tensor([5.0, 6.0]), "must be ints"),
    ((True, False), "must be ints"),
    ({"prompt_ids": [5]}, "prompt_token_ids"),
    (np.zeros((2, 2, 2), dtype=np.int64), "2-D"),
    (3.5, "sequence of prompts"),
    ([[5, 6], object()], r"prompts\[1\]"),
])
def test_bad_prompts_are_named(llm, prompt, message):
    with pytest.raises(InvalidArgumentError, match=message):
        llm.generate(prompt, GREEDY)
    assert not llm.engine.has_unfinished_requests()
