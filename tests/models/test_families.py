"""The Llama and Qwen2 families (and Llama 3 RoPE scaling, tied embeddings, biases) give
transformers' greedy output token for token in float32 on CPU; configs nanovllm cannot run are
rejected with the reason."""

import re

import pytest
import torch
from conftest import MAX_TOKENS, hf_greedy, make_model_dir
from conftest import PROMPTS as ALL_PROMPTS
from transformers import AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

from nanovllm import LLM, SamplingParams
from nanovllm.llm import prompt_logits

PROMPTS = ALL_PROMPTS[:3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TINY = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

VARIANTS = {
    # With original_max_position_embeddings=64 and head_dim 16, the llama3 rule leaves the fast
    # frequencies alone, divides the slow ones by 8 and blends the two in between: all three cases.
    "llama3-rope": dict(arch="llama", rope_parameters=LLAMA3_ROPE),
    "llama-tied-bias": dict(arch="llama", tie=True, attention_bias=True, mlp_bias=True),
    "qwen2": dict(arch="qwen2"),
    "qwen2-tied": dict(arch="qwen2", tie=True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_model_dir(path, **VARIANTS[request.param])
    hf.generation_config.eos_token_id = None
    llm = LLM(path, kvcache_block_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=256)
    return request.param, hf, llm, AutoTokenizer.from_pretrained(path)


def test_greedy_matches_transformers(family):
    name, hf, llm, tok = family
    reference = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in PROMPTS]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == reference, name


def test_logits_match_transformers(family):
    name, hf, llm, tok = family
    ids = tok.encode(PROMPTS[1])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(prompt_logits(llm, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama3-rope"], indirect=True)
def test_llama3_rope_scaling_changes_the_rotation(family):
    name, hf, llm, tok = family
    rotary = llm.engine.executor.model.model.layers[0].self_attn.attn.rotary
    positions = torch.arange(rotary.cos.shape[0], dtype=torch.float)[:, None]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    unscaled = torch.cat([positions * inv_freq] * 2, -1).cos()
    assert not torch.allclose(rotary.cos, unscaled, atol=1e-3)  # the scaling took effect


def _save_config(path, config) -> str:
    config.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("config", [
    MistralConfig(**TINY, sliding_window=32, architectures=["MistralForCausalLM"]),
    Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=1,
                architectures=["Qwen2ForCausalLM"]),
], ids=["mistral", "qwen2"])
def test_active_sliding_window_is_rejected(tmp_path, config):
    with pytest.raises(ValueError, match="sliding-window attention \\(sliding_window=32\\)"):
        LLM(_save_config(tmp_path, config), load_format="dummy", skip_tokenizer_init=True)


def test_mistral_without_sliding_window_runs_as_llama(tmp_path):
    config = MistralConfig(**TINY, sliding_window=None, architectures=["MistralForCausalLM"])
    llm = LLM(_save_config(tmp_path, config), load_format="dummy", skip_tokenizer_init=True,
              kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=8)
    assert type(llm.engine.executor.model).__name__ == "LlamaForCausalLM"
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]) == MAX_TOKENS


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    config = LlamaConfig(**TINY, architectures=["GPTNeoXForCausalLM"])
    supported = ("['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', "
                 "'Qwen3MoeForCausalLM']")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*not supported; supported architectures: "
                                         + re.escape(supported)):
        LLM(_save_config(tmp_path, config), load_format="dummy", skip_tokenizer_init=True)
