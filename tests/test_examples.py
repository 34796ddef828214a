"""Every script in examples/ runs as a user types it (`python examples/NAME.py`, with a small
--max-tokens to keep it fast) on its default model, SmolLM2-135M-Instruct, and prints what it promises."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

if embedded_model_path() is None:
    pytest.skip(f"the examples run SmolLM2, which is not installed: {EMBEDDED_INSTALL}",
                allow_module_level=True)
pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install -e '.[test]'")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
MAX_TOKENS = 8


def run(name: str, *args: str) -> str:
    """`python examples/NAME.py ARGS` from the repository root, on the CPU; its stdout."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, f"examples/{name}.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_example_is_run_here():
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    assert {path.stem for path in EXAMPLES.glob("*.py")} <= tested


def test_basic():
    out = run("basic", "--max-tokens", str(MAX_TOKENS))
    prompts = re.findall(r"^Prompt: +(.*)$", out, re.M)
    texts = re.findall(r"^Output: +(.*)$", out, re.M)
    assert [ast.literal_eval(p) for p in prompts] == [
        "Hello, my name is", "The president of the United States is", "The capital of France is",
        "The future of AI is"]
    assert len(texts) == 4 and all(ast.literal_eval(t).strip() for t in texts)


def test_chat():
    out = run("chat", "--max-tokens", str(MAX_TOKENS))
    prompts = [ast.literal_eval(p) for p in re.findall(r"^Prompt: (.*)$", out, re.M)]
    texts = [ast.literal_eval(t) for t in re.findall(r"^Generated text: (.*)$", out, re.M)]
    assert len(prompts) == len(texts) == 3  # one conversation, then a batch of two
    assert all(p.startswith("<|im_start|>") and p.endswith("<|im_start|>assistant\n") for p in prompts)
    assert "higher education" in prompts[0] and "Paris" in texts[1]  # greedy
    streamed = re.search(r"^Streamed: (.+)$", out, re.M)
    assert streamed and streamed.group(1).strip()


def test_logprobs():
    out = run("logprobs", "--max-tokens", str(MAX_TOKENS))
    generated = re.search(r"^Prompt logprobs:$", out, re.M).start()
    rows = re.findall(r"^ +('.*'|\".*\") logprob +(-?[\d.]+) rank (\w+)", out[:generated], re.M)
    assert 0 < len(rows) <= MAX_TOKENS
    assert ast.literal_eval(rows[0][0]) == " Paris" and all(rank == "1" for _, _, rank in rows)  # greedy
    cumulative = float(re.search(r"^Cumulative logprob: (-?[\d.]+)$", out, re.M).group(1))
    assert cumulative == pytest.approx(sum(float(lp) for _, lp, _ in rows), abs=1e-3 * len(rows))
    prompt_rows = re.findall(r"^ +('.*'|\".*\") logprob +(-?[\d.]+) rank (\w+)", out[generated:], re.M)
    assert [ast.literal_eval(token) for token, _, _ in prompt_rows] == [" capital", " of", " France", " is"]


def test_n_samples():
    out = run("n_samples", "--max-tokens", str(MAX_TOKENS), "--n", "2")
    assert len(re.findall(r"^  greedy: '.+'$", out, re.M)) == 2
    assert re.findall(r"^  sample (\d): ", out, re.M) == ["0", "1", "0", "1"]


def test_token_ids():
    out = run("token_ids", "--max-tokens", str(MAX_TOKENS))
    assert re.findall(r"\(text: (.*)\)$", out, re.M) == ["None", "None", "'Water boils at a temperature of'"]
    texts = [ast.literal_eval(t) for t in re.findall(r"^Generated text: (.*)$", out, re.M)]
    assert len(texts) == 3 and "Paris" in texts[0]
    ids = [ast.literal_eval(t) for t in re.findall(r"^Generated token ids: (.*)$", out, re.M)]
    assert all(len(i) == MAX_TOKENS for i in ids)


def test_ray_data():
    pytest.importorskip("ray", reason="the Ray Data example needs ray: pip install -e '.[ray]'")
    out = run("ray_data", "--replicas", "1", "--num-prompts", "2", "--max-tokens", "4")
    rows = re.findall(r"^\[(\d)\] (.*) -> (.*)$", out, re.M)
    assert [row[0] for row in rows] == ["0", "1"] and all(ast.literal_eval(row[2]) for row in rows)
