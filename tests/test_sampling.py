"""Sampling parameters end to end (seeds, top-k/p, min-p, stop conditions) and the sampler's
filters on crafted logits."""

import pytest
import torch
from conftest import PROMPTS as ALL_PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.layers.sampler import Sampler, SamplingTensors, row_argmax

PROMPTS = ALL_PROMPTS[:2]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=256, max_num_seqs=8)


def tokens(llm, params, prompts=PROMPTS):
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_top_k_1_equals_greedy(llm):
    greedy = tokens(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert tokens(llm, SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True)) == greedy


def test_same_seed_same_text_different_seeds_differ(llm):
    def seeded(seed, prompts=PROMPTS):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)
        return tokens(llm, params, prompts)

    assert seeded(7) == seeded(7)
    assert seeded(7) != seeded(8)
    # a seeded request's text does not depend on what else is in the batch
    assert seeded(7, PROMPTS[:1]) == seeded(7)[:1]


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    assert tokens(llm, params) != tokens(llm, params)


def test_max_tokens_and_finish_reason_length(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o["token_ids"]) == 5 and o["finish_reason"] == "length" for o in outputs)


def test_stop_token_ids_end_generation(llm):
    greedy = tokens(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    stop = greedy[5]
    first = greedy.index(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    assert out["token_ids"] == greedy[:first + 1] and out["finish_reason"] == "stop"


def test_stop_string_cuts_text_before_it(llm, tokenizer):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0]
    text = greedy["text"]
    stop = text[6:9]
    assert stop and text.find(stop) >= 0
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=stop), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:text.find(stop)]
    assert len(out["token_ids"]) < len(greedy["token_ids"])


def test_eos_stops_unless_ignored(tmp_path, tokenizer):
    """A model whose EOS is the 4th greedy token: generation stops there, unless ignore_eos."""
    import json
    import shutil

    from conftest import make_model_dir
    make_model_dir(str(tmp_path / "m"))
    probe = LLM(str(tmp_path / "m"), kvcache_block_size=4, max_model_len=256, max_num_seqs=4)
    greedy = tokens(probe, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    eos = greedy[3]
    model_dir = tmp_path / "eos"
    shutil.copytree(tmp_path / "m", model_dir)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(cfg))
    llm = LLM(str(model_dir), kvcache_block_size=4, max_model_len=256, max_num_seqs=4)
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert stopped["token_ids"] == greedy[:greedy.index(eos) + 1] and stopped["finish_reason"] == "stop"
    ignored = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0]
    assert ignored["token_ids"] == greedy and ignored["finish_reason"] == "length"


# ---- the sampler's filters on crafted logits ----
def sample_many(logits_row, n=400, **kw):
    logits = torch.tensor([logits_row] * n, dtype=torch.float32)
    b = logits.shape[0]
    t = SamplingTensors(torch.full((b,), kw.get("temperature", 1.0)), all_greedy=False)
    if "top_k" in kw:
        t.top_ks, t.max_top_k = torch.full((b,), kw["top_k"], dtype=torch.int64), kw["top_k"]
    if "top_p" in kw:
        t.top_ps = torch.full((b,), kw["top_p"])
    if "min_p" in kw:
        t.min_ps = torch.full((b,), kw["min_p"])
    return set(Sampler()(logits, t).tolist())


# probabilities ~ [0.4, 0.3, 0.15, 0.1, 0.05]
ROW = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log().tolist()


def test_top_k_never_leaves_its_set():
    assert sample_many(ROW, top_k=2) == {0, 1}


def test_top_p_never_leaves_its_set():
    # 0.4 + 0.3 = 0.7 < 0.75: the third token is needed to reach 0.75, the fourth is not
    assert sample_many(ROW, top_p=0.75) == {0, 1, 2}
    assert sample_many(ROW, top_p=0.01) == {0}


def test_min_p_never_leaves_its_set():
    # floor = 0.5 * 0.4 = 0.2: only tokens 0 (0.4) and 1 (0.3) survive
    assert sample_many(ROW, min_p=0.5) == {0, 1}


def test_plain_temperature_reaches_every_token():
    assert sample_many(ROW, n=2000) == {0, 1, 2, 3, 4}


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = torch.tensor([ROW, ROW] * 50)
    t = SamplingTensors(torch.tensor([0.0, 1.0] * 50), all_greedy=False)
    out = Sampler()(logits, t)
    assert set(out[0::2].tolist()) == {0} and len(set(out[1::2].tolist())) > 1


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_equals_argmax_with_first_index_on_ties(rows, dtype):
    """Few rows take the chunked reduction; the index must be argmax's, ties included."""
    gen = torch.Generator().manual_seed(rows)
    for vocab in (100, 1000, 151936):
        x = torch.randn(rows, vocab, generator=gen).to(dtype)
        x[:, 5::7] = x.max()  # the max tied in every chunk: the first one wins
        assert torch.equal(row_argmax(x), x.argmax(-1))
        few_values = torch.randint(0, 3, (rows, vocab), generator=gen).to(dtype)
        assert torch.equal(row_argmax(few_values), few_values.argmax(-1))
