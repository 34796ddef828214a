"""A real model: SmolLM2-135M-Instruct (GGUF, float32, CPU) asked to copy code. Prompt lookup proposes the
code it is copying; most drafts are accepted and greedy output is token for token the plain engine's,
also beside a structured output's row."""

import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

if embedded_model_path() is None:
    pytest.skip(f"SmolLM2 is not installed: {EMBEDDED_INSTALL}", allow_module_level=True)
pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install -e '.[test]'")

pytestmark = pytest.mark.slow
CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n")
CHATS = [[{"role": "user", "content": f"Repeat this code exactly, then add a function div in the same "
                                      f"style:\n{CODE}"}],
         [{"role": "user", "content": "Copy this sentence three times: The quick brown fox jumps over the "
                                      "lazy dog."}]]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=96)


@pytest.fixture(scope="module")
def plain():
    return LLM("smollm2", max_model_len=1024)


@pytest.fixture(scope="module")
def speculative():
    return LLM("smollm2", max_model_len=1024, speculative_config=SPEC)


def test_copying_accepts_most_drafts_and_keeps_greedy_output(plain, speculative):
    expected = plain.chat(CHATS, GREEDY, use_tqdm=False)
    outputs = speculative.chat(CHATS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert CODE.strip() in outputs[0]["text"]
    metrics = outputs[0].metrics
    assert metrics.num_accepted_tokens > 0.6 * metrics.num_draft_tokens
    assert metrics.num_accepted_tokens > 0.3 * len(outputs[0]["token_ids"])  # tokens that cost no step


def test_a_structured_output_row_speculates_beside_others(plain, speculative):
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar: pip install -e '.[test]'")
    chats = [*CHATS, [{"role": "user", "content": "Is the sky blue? Answer with a phone number."}]]
    constrained = SamplingParams(temperature=0, max_tokens=32,
                                 structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{3}-\d{4}"))
    params = [GREEDY, GREEDY, constrained]
    outputs = speculative.chat(chats, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in plain.chat(chats, params,
                                                                                       use_tqdm=False)]
    assert outputs[0].metrics.num_drafts > 0
