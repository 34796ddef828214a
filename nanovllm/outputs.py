"""What the engine returns. A request's output is a plain dict (nano-vllm's shape), described here as
TypedDicts: the first completion's fields at the top level (`out["text"]`, `out["token_ids"]`), and
all n completions, vLLM-style, in `out["outputs"]`. Also the per-step record the model runner hands
back to the engine (StepOutput). Pure Python."""

from dataclasses import dataclass
from typing import TypedDict

TokenLogprobs = dict[int, float]  # token id -> logprob: the top-k, and the chosen token's own


class CompletionOutput(TypedDict):
    index: int  # which of the request's n completions
    text: str  # "" with detokenize=False or without a tokenizer
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    stop_reason: int | str | None  # the stop token id or stop string that ended it; None for EOS/length
    logprobs: list[TokenLogprobs] | None  # per generated token; None unless SamplingParams.logprobs
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None unless logprobs


class RequestOutput(TypedDict):
    # The first completion, as nano-vllm always returned it:
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float | None
    # The request:
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None  # per prompt token, None at position 0
    num_cached_tokens: int  # prompt tokens served by the prefix cache (first completion)
    outputs: list[CompletionOutput]  # all n completions, in index order


@dataclass(slots=True)
class StepOutput:
    """One step's results, per scheduled sequence (row)."""

    token_ids: list[int | None]  # None: the row only computed part of its prompt (or not rank 0)
    logprobs: list[TokenLogprobs | None] | None = None  # the sampled token's and the top-k, if asked
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None  # row -> this chunk's prompt tokens
