"""The lm-evaluation-harness model "nanovllm" against lm-eval's own "hf" model on the same tiny
weights (float32, CPU), on local tasks (JSON files written here; no hub): per-item loglikelihoods,
rolling loglikelihoods (also over documents longer than max_length, in several windows) and generations
agree, and so do the metrics. `python -m nanovllm.eval` runs a task as a user types it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import nanovllm.integrations.lm_eval  # noqa: E402, F401  (registers "nanovllm")
from nanovllm.integrations.lm_eval import NanoVLLM  # noqa: E402

TOL = 1e-4
MC = [
    {"question": "Paris is the capital of", "choices": [" France", " Germany", " dog"], "answer": 0},
    {"question": "The quick brown fox jumps over the lazy", "choices": [" dog", " cat"], "answer": 0},
    {"question": "A paged KV cache splits memory into", "choices": [" fixed-size blocks", " fox"],
     "answer": 0},
    {"question": "Continuous batching admits new", "choices": [" requests", " world", " hello"], "answer": 1},
]
GEN = [{"question": "Paris is the capital of", "answer": " France"},
       {"question": "hello", "answer": " world"},
       {"question": "0123456789", "answer": " !?"}]
PPL = [{"text": "The quick brown fox jumps over the lazy dog."},
       {"text": "Berlin is the capital of Germany, and Paris is the capital of France."}]

TASKS = {
    "nano_mc": ("mc.jsonl", MC, """
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: choices
        doc_to_target: answer
        metric_list:
          - metric: acc
        """),
    "nano_gen": ("gen.jsonl", GEN, """
        output_type: generate_until
        doc_to_text: "{{question}}"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: [".", "\\n"]
          max_gen_toks: 6
          do_sample: false
        metric_list:
          - metric: exact_match
        """),
    "nano_ppl": ("ppl.jsonl", PPL, """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
        """),
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks")
    for task, (filename, rows, body) in TASKS.items():
        (path / filename).write_text("".join(json.dumps(r) + "\n" for r in rows))
        header = (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                  f"    test: {path / filename}\ntest_split: test\n")
        (path / f"{task}.yaml").write_text(header + textwrap.dedent(body))
    return path


def local_tasks(task_dir) -> TaskManager:
    # include_defaults=False: indexing lm-eval's ~14,000 built-in task files takes half a minute.
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def evaluate(model: str, model_args: str, task_dir) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a busy box
    try:
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                       task_manager=local_tasks(task_dir),
                                       log_samples=True, device="cpu", batch_size=1)
    finally:
        torch.set_num_threads(threads)


def by_doc(results: dict, task: str) -> list:
    """Every request's response, in document order (a multiple-choice document has one per choice)."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [resp[0] for s in samples for resp in s["resps"]]


@pytest.fixture(scope="module")
def both(qwen3_dir, task_dir):
    ours = evaluate("nanovllm", f"pretrained={qwen3_dir},max_model_len=256,kvcache_block_size=4", task_dir)
    ref = evaluate("hf", f"pretrained={qwen3_dir},dtype=float32", task_dir)
    return ours, ref


def test_loglikelihoods_and_accuracy_equal_hf(both):
    ours, ref = both
    got, want = by_doc(ours, "nano_mc"), by_doc(ref, "nano_mc")
    assert len(got) == sum(len(d["choices"]) for d in MC)
    for g, w in zip(got, want, strict=True):
        assert abs(float(g[0]) - float(w[0])) < TOL and bool(g[1]) == bool(w[1])
    assert ours["results"]["nano_mc"]["acc,none"] == ref["results"]["nano_mc"]["acc,none"]


def test_rolling_loglikelihoods_equal_hf(both):
    ours, ref = both
    for g, w in zip(by_doc(ours, "nano_ppl"), by_doc(ref, "nano_ppl"), strict=True):
        assert abs(float(g) - float(w)) < TOL
    assert ours["results"]["nano_ppl"]["word_perplexity,none"] == pytest.approx(
        ref["results"]["nano_ppl"]["word_perplexity,none"], rel=1e-4)


def test_generations_equal_hf(both):
    ours, ref = both
    got, want = by_doc(ours, "nano_gen"), by_doc(ref, "nano_gen")
    assert got == want and any(got)
    assert ours["results"]["nano_gen"]["exact_match,none"] == ref["results"]["nano_gen"]["exact_match,none"]


def rolling(model, texts: list[str]) -> list[float]:
    return model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), i)
                                        for i, text in enumerate(texts)], disable_tqdm=True)


def test_rolling_windows_score_every_token_as_hf_at_max_length(qwen3_dir):
    """Documents shorter than max_length, of exactly max_length tokens (one window of max_length + 1
    with the prefix token) and several times longer (several windows, each scoring its first token):
    equal to hf's at the same max_length, nanovllm's default for its max_model_len."""
    from lm_eval.models.huggingface import HFLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        max_model_len = 34
        ours = NanoVLLM(qwen3_dir, max_model_len=max_model_len, kvcache_block_size=4)
        max_length = ours.max_length
        assert max_length == max_model_len - 2
        hf = HFLM(pretrained=qwen3_dir, dtype="float32", max_length=max_length, device="cpu", batch_size=1)
        long = " ".join(PPL[1]["text"] for _ in range(6))
        texts = {}  # token count -> a prefix of `long` with that many tokens
        for end in range(1, len(long) + 1):
            texts.setdefault(len(ours.tok_encode(long[:end])), long[:end])
        lengths = (5, max_length - 1, max_length, max_length + 1, 2 * max_length, max(texts))
        assert lengths[-1] > 3 * max_length
        chosen = [texts[n] for n in lengths]
        got, want = rolling(ours, chosen), rolling(hf, chosen)
        assert got == pytest.approx(want, abs=TOL)
        with pytest.raises(ValueError, match="max_model_len >= max_length"):
            NanoVLLM(qwen3_dir, max_model_len=max_model_len, max_length=max_model_len - 1)
    finally:
        torch.set_num_threads(threads)


def test_cli_runs_a_task_without_device_on_a_cpu(qwen3_dir, task_dir, tmp_path):
    """`python -m nanovllm.eval --model nanovllm ...` as a user types it, with no --device: lm-eval
    asks for cuda:0, which falls back to the CPU as lm-eval's hf model does."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([
        sys.executable, "-m", "nanovllm.eval", "--model", "nanovllm", "--model_args",
        f"pretrained={qwen3_dir},max_model_len=256,kvcache_block_size=4", "--tasks", "nano_mc",
        "--include_path", str(task_dir), "--output_path", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nano_mc" in done.stdout and "acc" in done.stdout
    assert "CUDA is not available; running on the CPU" in done.stderr
    assert list(tmp_path.rglob("results_*.json"))


def test_cli_help_says_how_to_use_the_nanovllm_model():
    done = subprocess.run([sys.executable, "-m", "nanovllm.eval", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--model nanovllm --model_args pretrained=" in done.stdout and "max_length" in done.stdout
    assert "usage: lm-eval" in done.stdout  # lm-eval's own usage follows
