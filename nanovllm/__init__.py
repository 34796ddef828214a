"""nanovllm: a compact, fast, offline LLM inference engine.

`LLM` is imported on first use: `import nanovllm` (and the engine's plain-Python bookkeeping under
nanovllm.engine) needs no torch."""

from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "TextPrompt", "TokensPrompt"]


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    if name in ("TextPrompt", "TokensPrompt"):  # vLLM's prompt dicts
        from nanovllm.engine import validation

        return getattr(validation, name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
