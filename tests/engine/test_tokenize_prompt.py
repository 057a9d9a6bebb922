"""`tokenize_prompt`: a token-id prompt is checked for its types and against the vocabulary, naming the bad value."""

import enum

import pytest

from pagedkv.engine.output_processor import tokenize_prompt
from pagedkv.errors import InvalidArgumentError


class Token(enum.IntEnum):
    A = 3


def test_token_ids_in_the_vocabulary_pass_as_a_list():
    assert tokenize_prompt(None, 10, (0, 9, 5)) == (None, [0, 9, 5])
    assert tokenize_prompt(None, 10, [Token.A, 2]) == (None, [Token.A, 2])  # int subclasses are ints
    assert tokenize_prompt(None, None, [10**9]) == (None, [10**9])  # no vocabulary: no range check
    assert tokenize_prompt(None, 10, []) == (None, [])


@pytest.mark.parametrize("prompt", [[1, True], [1, 2.0], [1, "2"], {1, 2}, 7, [None]])
def test_anything_but_int_token_ids_is_refused(prompt):
    with pytest.raises(InvalidArgumentError, match="a prompt must be a str or a list of token ids"):
        tokenize_prompt(None, 10, prompt)


@pytest.mark.parametrize("prompt, bad", [([1, 10, 11], 10), ([3, -1, 12], -1), ([12, -1], 12)])
def test_the_first_token_outside_the_vocabulary_is_named(prompt, bad):
    with pytest.raises(InvalidArgumentError, match=rf"token id {bad} is outside the vocabulary \[0, 10\)"):
        tokenize_prompt(None, 10, prompt)


def test_a_long_prompt_is_checked_whole():
    prompt = list(range(16384))
    assert tokenize_prompt(None, 16384, prompt)[1] == prompt
    with pytest.raises(InvalidArgumentError, match="token id 16384 is outside"):
        tokenize_prompt(None, 16384, prompt + [16384])
