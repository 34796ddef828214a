"""Penalties, min_tokens, logit_bias, allowed_token_ids and bad_words against a reference applied to
transformers' logits step by step (greedy, float32: token-exact), each request in a mixed batch; and
the output options: stop_reason, include_stop_str_in_output, detokenize, skip_special_tokens."""

from collections import Counter

import pytest
import torch
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.engine.requests import bad_words_token_ids

NUM_TOKENS = 12


# Tiny models run fastest on one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=256, max_num_seqs=8)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": NUM_TOKENS, "ignore_eos": True, **kw})


def hf_reference(hf, prompt: list[int], transform, num_tokens: int = NUM_TOKENS,
                 stop_ids: tuple[int, ...] = (), min_tokens: int = 0) -> list[int]:
    """Greedy decoding in transformers with transform(logits, prompt, output) applied at each step."""
    output: list[int] = []
    for _ in range(num_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
        token = int(transform(logits.clone(), prompt, output).argmax())
        output.append(token)
        if token in stop_ids and len(output) > min_tokens:
            break
    return output


def ref_penalties(rep: float = 1.0, freq: float = 0.0, pres: float = 0.0):
    def transform(logits, prompt, output):
        for tok in set(prompt) | set(output):
            logits[tok] = logits[tok] / rep if logits[tok] > 0 else logits[tok] * rep
        for tok, count in Counter(output).items():
            logits[tok] -= freq * count + pres
        return logits
    return transform


def identity(logits, prompt, output):
    return logits


PENALTIES = [dict(repetition_penalty=2.0), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=0.7)]


def test_penalties_match_reference_in_a_mixed_batch(llm, hf_qwen3, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1])
    params = [greedy(**p) for p in PENALTIES] + [greedy()]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    plain = hf_reference(hf_qwen3, prompt, identity)
    assert outputs[-1]["token_ids"] == plain
    for penalty, out in zip(PENALTIES, outputs):
        expected = hf_reference(hf_qwen3, prompt, ref_penalties(penalty.get("repetition_penalty", 1.0),
                                                               penalty.get("frequency_penalty", 0.0),
                                                               penalty.get("presence_penalty", 0.0)))
        assert out["token_ids"] == expected, penalty
    assert any(out["token_ids"] != plain for out in outputs[:-1])  # the penalties did change something


def test_logit_bias_and_allowed_token_ids(llm, hf_qwen3, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])
    plain = hf_reference(hf_qwen3, prompt, identity)
    favored, banned = 42, plain[0]
    allowed = sorted({plain[3], 7, 99, 150})
    params = [greedy(logit_bias={favored: 100.0}), greedy(logit_bias={banned: -100.0, 5: 3.0}),
              greedy(allowed_token_ids=allowed)]
    outs = [o["token_ids"] for o in llm.generate([prompt] * 3, params, use_tqdm=False)]

    def bias(table):
        def transform(logits, p, o):
            for tok, b in table.items():
                logits[tok] += b
            return logits
        return transform

    def only(logits, p, o):
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0
        return logits + mask
    assert outs[0] == hf_reference(hf_qwen3, prompt, bias({favored: 100.0})) == [favored] * NUM_TOKENS
    assert outs[1] == hf_reference(hf_qwen3, prompt, bias({banned: -100.0, 5: 3.0}))
    assert banned not in outs[1]
    assert outs[2] == hf_reference(hf_qwen3, prompt, only) and set(outs[2]) <= set(allowed)


def test_min_tokens_ignores_stop_ids_and_eos_until_reached(llm, hf_qwen3, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1])
    plain = hf_reference(hf_qwen3, prompt, identity)
    stop = plain[1]
    eos = tokenizer.eos_token_id
    out = llm.generate(prompt, greedy(stop_token_ids=[stop], min_tokens=5, ignore_eos=False),
                       use_tqdm=False)[0]

    def mask_until_min(logits, p, o):
        if len(o) < 5:
            logits[[stop, eos]] = float("-inf")
        return logits
    expected = hf_reference(hf_qwen3, prompt, mask_until_min, stop_ids=(stop, eos), min_tokens=5)
    assert out["token_ids"] == expected
    assert stop not in out["token_ids"][:5] and len(out["token_ids"]) > 5
    if out["finish_reason"] == "stop" and out["token_ids"][-1] == stop:
        assert out["stop_reason"] == stop
    # without min_tokens it stops at the stop id's first appearance
    early = llm.generate(prompt, greedy(stop_token_ids=[stop]), use_tqdm=False)[0]
    assert early["token_ids"] == plain[:2] and early["stop_reason"] == stop


def test_bad_words_never_completed(llm, hf_qwen3, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1])
    plain = hf_reference(hf_qwen3, prompt, identity)
    single = tokenizer.decode(plain[0])
    double = tokenizer.decode(plain[2:4])
    words = [single, double]
    ids = bad_words_token_ids(words, tokenizer)
    assert ids[0] == tokenizer.encode(single.lstrip(), add_special_tokens=False)
    out = llm.generate(prompt, greedy(bad_words=words), use_tqdm=False)[0]["token_ids"]

    def ban(logits, p, o):
        for word in ids:
            if len(word) == 1 or o[len(o) - len(word) + 1:] == word[:-1] and len(o) >= len(word) - 1:
                logits[word[-1]] = float("-inf")
        return logits
    assert out == hf_reference(hf_qwen3, prompt, ban)
    for word in ids:
        assert all(out[i:i + len(word)] != word for i in range(len(out)))


def test_stop_string_reason_and_include_stop_str(llm):
    text = llm.generate(PROMPTS[0], greedy(max_tokens=24), use_tqdm=False)[0]["text"]
    stop = text[6:9]
    cut = text.find(stop)
    out = llm.generate(PROMPTS[0], greedy(max_tokens=24, stop=[stop, "#never#"]), use_tqdm=False)[0]
    assert out["text"] == text[:cut] and out["stop_reason"] == stop and out["finish_reason"] == "stop"
    kept = llm.generate(PROMPTS[0], greedy(max_tokens=24, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    assert kept["text"] == text[:cut + len(stop)] and kept["token_ids"] == out["token_ids"]
    length = llm.generate(PROMPTS[0], greedy(max_tokens=3), use_tqdm=False)[0]
    assert length["stop_reason"] is None and length["finish_reason"] == "length"


def test_detokenize_and_special_tokens(llm, tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = greedy(max_tokens=3, allowed_token_ids=[special])
    out = llm.generate(PROMPTS[0], forced, use_tqdm=False)[0]
    assert out["token_ids"] == [special] * 3 and out["text"] == ""  # skipped by default
    shown = llm.generate(PROMPTS[0], greedy(max_tokens=3, allowed_token_ids=[special],
                                            skip_special_tokens=False), use_tqdm=False)[0]
    assert shown["text"] == "<|im_start|>" * 3
    raw = llm.generate(PROMPTS[0], greedy(max_tokens=5, detokenize=False), use_tqdm=False)[0]
    assert raw["text"] == "" and len(raw["token_ids"]) == 5
