"""What a finished request returns, readable both ways: as vLLM's RequestOutput (`out.outputs[0].text`,
`out.prompt_token_ids`, `out.finished`) and as nano-vllm's dict (`out["text"]`, `out["token_ids"]`,
`"error" in out`). A RequestOutput and a CompletionOutput are dicts with vLLM's attribute names as
properties over their keys, so every dict use (`.get`, `in`, `**out`, pickling across process pipes)
keeps working, and building one costs about what building a dict does. Pure Python.

Logprobs are vLLM's `list[dict[token_id, Logprob]]`; `Logprob` is a float (see there why)."""

# The first completion's fields, which a request's output also holds at its top level (nano-vllm's shape).
FIRST_COMPLETION_KEYS = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs",
                         "cumulative_logprob")


class Logprob(float):
    """vLLM's Logprob: `logprob`, `rank` (the token's place in the whole distribution, 1 = most likely,
    counted on the device as vLLM counts it: how many tokens are at least as likely) and
    `decoded_token` (its text, decoded when first read; None with detokenize=False or no tokenizer).

    NOTE: a float, where vLLM's is a dataclass. nano-vllm's logprobs were `{token_id: float}`, and code
    written for them (tests, lm-eval's adapter, JSON encoding, `sum`, `max(d, key=d.get)`) keeps
    working with the number itself; `lp.logprob` is there for code written for vLLM. It compares and
    hashes as its float (rank and text are not part of equality, as a float's fields are not)."""

    __slots__ = ("rank", "_token_id", "_tokenizer", "_decoded")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None,
                token_id: int | None = None, tokenizer=None) -> "Logprob":
        self = float.__new__(cls, logprob)
        self.rank, self._token_id, self._tokenizer, self._decoded = rank, token_id, tokenizer, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def decoded_token(self) -> str | None:
        if self._tokenizer is not None:  # lazily: most logprobs are only ever read as numbers
            self._decoded = self._tokenizer.decode([self._token_id])  # as vLLM decodes one token
            self._tokenizer = None
        return self._decoded

    def __reduce__(self) -> tuple:
        # Across a process pipe the text goes, not the tokenizer.
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    __str__ = float.__repr__  # print(lp) and f"{lp}" show the number, as they did


TokenLogprobs = dict[int, float]  # token id -> logprob (a Logprob in outputs): the top-k, and the chosen one
SampleLogprobs = list[dict[int, Logprob]]  # per generated token, as vLLM's
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token, None at position 0


def _key(name: str, doc: str) -> property:
    def get(self):
        return self[name]

    def put(self, value) -> None:
        self[name] = value

    return property(get, put, doc=doc)


class CompletionOutput(dict):
    """One of a request's n completions: vLLM's CompletionOutput, and a dict of the same keys."""

    __slots__ = ()
    index = _key("index", "which of the request's n completions")
    text = _key("text", '"" with detokenize=False or without a tokenizer; cut at a stop string that ended it')
    token_ids = _key("token_ids", "the generated token ids")
    cumulative_logprob = _key("cumulative_logprob",
                              "sum of the sampled tokens' logprobs; None unless logprobs")
    logprobs = _key("logprobs", "per generated token, {token id: Logprob}; None unless logprobs")
    finish_reason = _key("finish_reason", '"stop" (EOS, a stop string or stop token id), "length", "abort" '
                         "(abort_request, or a generate or stream call left early) or \"error\" (the request "
                         "failed inside a step)")
    stop_reason = _key("stop_reason", "the stop token id or stop string that ended it; None for EOS/length")

    def finished(self) -> bool:
        return self.get("finish_reason") is not None


class RequestMetrics(dict):
    """vLLM's RequestOutput.metrics, as far as nanovllm keeps them: speculative decoding's figures,
    summed over the request's completions (all 0 without speculation), and a dict of the same keys."""

    __slots__ = ()
    num_drafts = _key("num_drafts", "steps that verified drafts for it")
    num_draft_tokens = _key("num_draft_tokens", "draft tokens verified for it")
    num_accepted_tokens = _key("num_accepted_tokens", "draft tokens accepted: output tokens it got for free")

    @classmethod
    def zero(cls) -> "RequestMetrics":
        return cls(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)


class RequestOutput(dict):
    """A finished request: vLLM's RequestOutput (request_id, prompt, prompt_token_ids, prompt_logprobs,
    outputs, finished, num_cached_tokens), and nano-vllm's dict: the first completion's fields at the top
    level (FIRST_COMPLETION_KEYS), "prompt_token_ids", "prompt_logprobs", "num_cached_tokens", "outputs",
    "metrics", and, only when the request failed inside a step, "error" (the exception's type and text).

    `request_id` is the id add_request returned (an int; vLLM's are strings its caller chooses);
    `prompt` is the prompt's text (the chat template's output for `chat`), None for token ids. Both are
    attributes, not keys."""

    __slots__ = ("request_id", "prompt")
    prompt_token_ids = _key("prompt_token_ids", "the prompt's token ids")
    prompt_logprobs = _key("prompt_logprobs", "per prompt token, {token id: Logprob}, None at position 0; "
                           "None unless prompt_logprobs")
    outputs = _key("outputs", "all n completions (CompletionOutput), in index order")
    num_cached_tokens = _key("num_cached_tokens", "prompt tokens served by the prefix cache at the latest "
                             "admission (completion 0)")
    metrics = _key("metrics", "RequestMetrics: speculative decoding's drafts and accepted tokens")

    def __init__(self, *args, request_id: int | None = None, prompt: str | None = None, **fields) -> None:
        super().__init__(*args, **fields)
        self.request_id, self.prompt = request_id, prompt

    @property
    def finished(self) -> bool:
        return True  # an output is made once its request has ended

    @classmethod
    def of(cls, output: dict, request_id: int, prompt: str | None) -> "RequestOutput":
        """`output`, handed to the caller that asked for it under request_id: with that id (a data-parallel
        replica numbers requests its own way) and the prompt's text. A plain dict (some process made it
        for a request that ended without running: a replica that refused it) is filled in to the same
        keys."""
        if not isinstance(output, RequestOutput):
            output = cls._filled(output)
        output.request_id, output.prompt = request_id, prompt
        return output

    @classmethod
    def _filled(cls, output: dict) -> "RequestOutput":
        first = {"text": "", "token_ids": [], "finish_reason": "error", "stop_reason": None, "logprobs": None,
                 "cumulative_logprob": None}
        first.update((k, output[k]) for k in FIRST_COMPLETION_KEYS if k in output)
        full = cls(first, prompt_token_ids=[], prompt_logprobs=None, num_cached_tokens=0,
                   outputs=[CompletionOutput(first, index=0)], metrics=RequestMetrics.zero())
        full.update(output)
        return full
