"""The lm-evaluation-harness model "nanovllm" against lm-eval's own "hf" model on the same tiny
weights (float32, CPU), on local tasks (JSON files written here; no hub): per-item loglikelihoods,
rolling loglikelihoods and generations agree, and so do the metrics."""

import json
import os
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

import nanovllm.integrations.lm_eval  # noqa: E402, F401  (registers "nanovllm")

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


def test_cli_module_runs_a_task(qwen3_dir, task_dir, tmp_path, monkeypatch, capsys):
    """`python -m nanovllm.eval --model nanovllm ...` registers the model and runs lm-eval's CLI (run
    in-process here, with lm-eval's built-in tasks left unindexed to keep it fast)."""
    import lm_eval.tasks.manager as manager

    from nanovllm import eval as nanovllm_eval
    init = manager.TaskManager.__init__
    monkeypatch.setattr(manager.TaskManager, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "include_defaults": False}))
    monkeypatch.setattr(sys, "argv", [
        "nanovllm.eval", "--model", "nanovllm", "--model_args",
        f"pretrained={qwen3_dir},max_model_len=256,kvcache_block_size=4", "--tasks", "nano_mc",
        "--include_path", str(task_dir), "--device", "cpu", "--output_path", str(tmp_path)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nanovllm_eval.main()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "nano_mc" in out and "acc" in out
    assert list(tmp_path.rglob("results_*.json"))
