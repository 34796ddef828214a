"""A prompt's token ids as validation takes them: exact ints pass on the fast path, other int types
(not bool) on the slow one, and every bad id is reported the same way either way."""

import enum

import pytest

from nanovllm.engine.validation import tokenize_prompt


class Token(enum.IntEnum):
    A = 3


def test_int_subclasses_pass_and_bools_do_not():
    assert tokenize_prompt((1, Token.A, 2), None, 10) == [1, 3, 2]
    with pytest.raises(TypeError, match="list of token ids"):
        tokenize_prompt([1, False], None, 10)
    with pytest.raises(TypeError, match="list of token ids"):
        tokenize_prompt([1, "2"], None, 10)


def test_out_of_range_ids_are_listed():
    with pytest.raises(ValueError, match=r"\[10, -1, 12\] are outside the vocabulary \[0, 10\)"):
        tokenize_prompt([0, 10, 5, -1, 12], None, 10)
    assert tokenize_prompt([0, 9], None, 10) == [0, 9]
