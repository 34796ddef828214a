"""A request as the engine tracks it: its tokens, how many of them have KV in the cache, and the
KV blocks that hold them. Pure Python."""

from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

# Stands for the token a step in flight is sampling, until its id reaches the host (overlap scheduling,
# nanovllm.engine.overlap). Never a vocabulary id: a read of it before it is replaced fails loudly.
PENDING_TOKEN_ID = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 block_size: int = 256) -> None:
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params or SamplingParams()
        # |-- num_cached_tokens --|-- computed since admission --|-- not computed yet --|
        # |<----------- num_computed_tokens ------------------->|
        # num_cached_tokens: KV served by the prefix cache at the latest admission.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0  # tokens the scheduler gave this sequence in the current step
        # Speculative decoding (nanovllm.speculative): the draft tokens its next step verifies ([]: none);
        # that step computes its last token and these, num_scheduled_tokens = 1 + len(spec_token_ids).
        self.spec_token_ids: list[int] = []
        # The draft model's side: how many of its tokens have KV in the draft's own cache.
        self.num_draft_computed_tokens = 0
        # Drafts verified for it and how many of them were accepted (its output's metrics).
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        # Whether its latest verification rejected a draft: its next verification is not overlapped
        # (nanovllm.engine.overlap), since the step after it would likely be computed for nothing.
        self.rejected_drafts = False
        # Overlap scheduling: tokens at the end of token_ids that a step in flight only assumes (its
        # pending token, and the drafts it verifies, taken as accepted); 0 between engine steps.
        self.num_assumed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block whose KV is computed
        self.finish_reason: str | None = None
        self.stop_text: str | None = None  # the completion text, cut at the stop string that hit
        self.num_preemptions = 0
        params = self.sampling_params
        # n > 1: completion i of a request samples with seed + i (distinct, reproducible), and waits
        # for completion 0 (its leader) to compute the prompt, so it finds the prompt's KV blocks in
        # the prefix cache instead of computing them again.
        self.completion_index = 0
        self.leader: Sequence | None = None
        self.seed = params.seed
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # Filled by the engine from the tokenizer and EOS ids (the runner reads them on rank 0).
        self.bad_words_token_ids: list[list[int]] = []
        self.min_tokens_stop_ids: list[int] = []  # masked while fewer than min_tokens are generated
        # Structured outputs: the sequence's grammar matcher (xgrammar.GrammarMatcher), advanced with
        # each accepted token (nanovllm.engine.structured_outputs); None without a constraint.
        self.grammar = None
        # Whether the runner must build logits processors for it (a per-step check stays one attribute).
        self.uses_logits_processors = params.uses_logits_processors
        self.reads_output_tokens = params.reads_output_tokens
        self.logprobs: list[dict[int, float]] | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        # prompt_logprobs[p]: the logprobs of prompt token p (None for p = 0, as vLLM).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            None if params.prompt_logprobs is None else [None])

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last token lacks KV: the sequence still computes its prompt (or, after a
        preemption, recomputes prompt and completion) in chunks before it decodes again."""
        return self.num_uncomputed_tokens > 1

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_computed(self) -> bool:
        """Whether the prompt's KV is (or was, for a finished sequence) computed once."""
        return self.is_finished or self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: such a sequence is not served from the
        prefix cache (cached KV has no logits). A preempted sequence that recomputes its prompt
        after they are complete does not compute them again."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_logprob_span(self) -> tuple[int, int] | None:
        """Positions [lo, hi) of this step's chunk whose logits give the logprobs of prompt tokens
        lo+1 .. hi (the last prompt position predicts the first generated token instead):

            prompt:  | t0 | t1 | ... | t(P-1) |
            logits:  | ->t1 | ->t2 | ... | ->first generated |
        """
        if not self.needs_prompt_logprobs:
            return None
        lo = max(self.num_computed_tokens, len(self.prompt_logprobs) - 1)
        hi = min(self.num_computed_tokens + self.num_scheduled_tokens, self.num_prompt_tokens - 1)
        return (lo, hi) if lo < hi else None

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
