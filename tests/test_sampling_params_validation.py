"""SamplingParams validation that cannot be bypassed (issue 12, item 2): every field is checked at
construction and again when the engine adds the request, so a value changed afterwards is refused
there, with a clear error, and the engine keeps serving. Numeric ranges stay safe in float32."""

import math

import pytest
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import MIN_TEMPERATURE

# Tiny models run fastest on one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=256, max_num_seqs=8)


GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)

# (field, bad value, exception): each is refused at construction and, set afterwards, at add time.
BAD = [
    ("temperature", 10**400, ValueError), ("temperature", math.nan, ValueError),
    ("temperature", math.inf, ValueError), ("temperature", -1.0, ValueError), ("temperature", "1", TypeError),
    ("temperature", 1e39, ValueError),  # inf as a float32
    ("top_p", 0.0, ValueError), ("top_p", 1.5, ValueError), ("top_p", math.nan, ValueError),
    ("top_k", -2, ValueError), ("top_k", 2.5, TypeError), ("top_k", True, TypeError),
    ("top_k", "5", TypeError),
    ("min_p", 1.1, ValueError), ("max_tokens", 0, ValueError), ("max_tokens", True, TypeError),
    ("max_tokens", 8.0, TypeError), ("n", 0, ValueError), ("n", True, TypeError),
    ("n", 10**9, ValueError),
    ("ignore_eos", "no", TypeError), ("ignore_eos", 1, TypeError), ("detokenize", "False", TypeError),
    ("skip_special_tokens", None, TypeError), ("spaces_between_special_tokens", 0, TypeError),
    ("include_stop_str_in_output", "yes", TypeError),
    ("presence_penalty", 2.5, ValueError), ("frequency_penalty", -3, ValueError),
    ("frequency_penalty", math.inf, ValueError), ("repetition_penalty", 0.0, ValueError),
    ("repetition_penalty", 1e-45, ValueError), ("repetition_penalty", 10**400, ValueError),
    ("min_tokens", -1, ValueError), ("min_tokens", 100, ValueError), ("min_tokens", False, TypeError),
    ("logprobs", -1, ValueError), ("logprobs", 21, ValueError), ("logprobs", True, TypeError),
    ("prompt_logprobs", 1.0, TypeError), ("seed", 1.5, TypeError), ("seed", True, TypeError),
    ("stop", 5, TypeError), ("stop", [""], ValueError), ("stop_token_ids", [-1], ValueError),
    ("stop_token_ids", [True], TypeError), ("logit_bias", [(1, 2.0)], TypeError),
    ("logit_bias", {"1": 2.0}, TypeError), ("logit_bias", {1: math.nan}, ValueError),
    ("allowed_token_ids", [], ValueError), ("allowed_token_ids", [1.0], TypeError),
    ("bad_words", "word", TypeError), ("bad_words", [" "], ValueError),
]


@pytest.mark.parametrize("name,value,error", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_bad_value_refused_at_construction(name, value, error):
    with pytest.raises(error, match=name if name not in ("logit_bias",) else "logit_bias"):
        SamplingParams(**{**GREEDY, name: value})


def test_values_changed_after_construction_are_refused_at_add_and_engine_keeps_serving(llm):
    expected = llm.generate(PROMPTS[0], SamplingParams(**GREEDY), use_tqdm=False)[0]["token_ids"]
    for name, value, error in BAD:
        params = SamplingParams(**GREEDY)
        setattr(params, name, value)
        with pytest.raises(error):
            llm.add_request(PROMPTS[0], params)
        with pytest.raises(error):
            llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(**GREEDY), params], use_tqdm=False)
    assert llm.is_finished() and not llm.engine._requests.live  # nothing half-added
    assert llm.generate(PROMPTS[0], SamplingParams(**GREEDY), use_tqdm=False)[0]["token_ids"] == expected


def test_token_ids_outside_the_vocabulary_refused_at_add(llm):
    vocab = llm.config.hf_config.vocab_size
    for kw in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[0, vocab]),
               dict(stop_token_ids=[vocab + 5])):
        params = SamplingParams(**GREEDY, **kw)  # no vocabulary known yet: accepted here ...
        with pytest.raises(ValueError, match="vocabulary"):
            llm.add_request(PROMPTS[0], params)  # ... and refused by the engine


def test_extreme_values_that_are_accepted_behave(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    greedy = [o["token_ids"] for o in greedy]

    def run(**kw):
        return [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(**{**GREEDY, **kw}),
                                                      use_tqdm=False)]
    # top_p that is 0 in float32 keeps the top token (it used to mask every token and give token 0)
    assert run(temperature=1.0, top_p=1e-50) == greedy
    # a temperature below MIN_TEMPERATURE is raised to it (1e-45 is 0 in float32 and gave token 0)
    params = SamplingParams(**{**GREEDY, "temperature": 1e-45})
    assert params.temperature == MIN_TEMPERATURE
    assert run(temperature=1e-45) == greedy
    # top_k beyond the vocabulary (once an int64 overflow in the step) means no top-k
    assert run(temperature=1.0, top_k=2**63, seed=5) == run(temperature=1.0, seed=5)
    # an int temperature that fits a float is fine; logit_bias beyond +-100 is clamped like vLLM's
    assert run(temperature=0) == greedy
    assert SamplingParams(logit_bias={3: 1e6}).logit_bias == {3: 100.0}


def test_unknown_option_rejected():
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)
