"""What a finished request returns. A request's output is a plain dict (nano-vllm's shape), described
here as TypedDicts: the first completion's fields at the top level (`out["text"]`, `out["token_ids"]`),
and all n completions, vLLM-style, in `out["outputs"]`. Pure Python."""

from typing import NotRequired, TypedDict

TokenLogprobs = dict[int, float]  # token id -> logprob: the top-k, and the chosen token's own


class CompletionOutput(TypedDict):
    index: int  # which of the request's n completions
    text: str  # "" with detokenize=False or without a tokenizer; cut at a stop string that ended it
    token_ids: list[int]
    # "stop" (EOS, a stop string or stop token id), "length", "abort" (abort_request, or a generate or
    # stream call that was left early) or "error" (the request failed inside a step)
    finish_reason: str
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
    num_cached_tokens: int  # prompt tokens served by the prefix cache at the latest admission (completion 0)
    outputs: list[CompletionOutput]  # all n completions, in index order
    # Only when the request failed inside a step (its unfinished completions end with "error"): the
    # exception's type and text.
    error: NotRequired[str]
