"""The step record: everything a step's forward pass and sampler need, as plain Python
lists, built once on rank 0 from the scheduled sequences. It is what the tensor-parallel workers
receive (pickled, without the sampling part: only rank 0 samples), and what the eager path, the
CUDA-graph path and the sampler all read. Also what a step returns on rank 0 (StepOutput). Pure Python.

Per scheduled sequence, the tokens it computes this step are the last `q_len` of its context:

    token ids:  |---- num_computed_tokens ----|---- scheduled (q_len) ----|---- later chunks ----|
                                              ^ start                    ^ end = seqlens_k[i]
    slot = block_table[pos // block_size] * block_size + pos % block_size
"""

from dataclasses import dataclass, field
from typing import Protocol

from nanovllm.outputs import TokenLogprobs

# Mixes a request's seed with the index of the token being sampled, so each step of a seeded request
# draws fresh noise that depends only on (seed, index): reproducible across batches and preemption.
SEED_STRIDE = 0x9E3779B97F4A7C15
SEED_MASK = (1 << 63) - 1


class ScheduledSequence(Protocol):
    """What building a batch reads of a scheduled sequence (nanovllm.engine.sequence.Sequence)."""

    token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]
    block_size: int
    sampling_params: object  # nanovllm.sampling_params.SamplingParams
    spec_token_ids: list[int]  # draft tokens this step verifies (speculative decoding; [] none)
    seed: int | None  # the request's seed + the completion's index (n > 1)
    num_prompt_tokens: int
    num_completion_tokens: int
    completion_token_ids: list[int]
    uses_logits_processors: bool
    min_tokens_stop_ids: list[int]
    bad_words_token_ids: list[list[int]]
    grammar: "TokenGrammar | None"

    def __len__(self) -> int: ...

    def prompt_logprob_span(self) -> tuple[int, int] | None: ...


class TokenGrammar(Protocol):
    """What the runner reads of a structured output's matcher (xgrammar.GrammarMatcher, built by
    nanovllm.engine.structured_outputs): the tokens its grammar allows next, as bits of row `index`
    of an int32 [rows, ceil(vocab / 32)] bitmask."""

    def fill_next_token_bitmask(self, bitmask: object, index: int) -> object: ...


class DraftedGrammar:
    """A sequence's matcher as it stands after `drafts` (speculative decoding: the drafts before a
    verified position, cut by structured_outputs.grammar_prefix to what the grammar allows): fills that
    position's bitmask row by taking the drafts and rolling them back, so the matcher itself stays at
    the sequence's tokens. A TokenGrammar to the runner."""

    __slots__ = ("matcher", "drafts")

    def __init__(self, matcher: object, drafts: list[int]) -> None:
        self.matcher, self.drafts = matcher, drafts

    def fill_next_token_bitmask(self, bitmask: object, index: int) -> None:
        matcher = self.matcher
        for token in self.drafts:
            matcher.accept_token(token)
        try:
            if matcher.is_terminated():  # a stop token among the drafts: the output ends before here
                bitmask[index] = -1
            else:
                matcher.fill_next_token_bitmask(bitmask, index)
        finally:
            matcher.rollback(len(self.drafts))


@dataclass(slots=True)
class ProcessorRow:
    """One sampling row's logits processors (nanovllm.layers.logits_processors applies them)."""

    allowed_token_ids: list[int] | None  # None: every token
    banned_token_ids: list[int]  # min_tokens' stop ids, and the tokens that would complete a bad word
    logit_bias: dict[int, float] | None
    penalties: tuple[float, float, float] | None  # (repetition, frequency, presence); None: neutral
    prompt_token_ids: list[int]  # the penalties' "seen" tokens ([] without penalties)
    output_token_ids: list[int]
    # Structured outputs: the sequence's matcher (rank 0 only, like the whole SamplingBatch), read-only
    # here; the engine advances it once the sampled token is accepted.
    grammar: TokenGrammar | None = None


@dataclass(slots=True)
class SamplingBatch:
    """Sampling parameters of the rows that sample, in `StepBatch.logits_indices` order: one per
    sampling sequence, or with speculative decoding one per position it verifies (see StepBatch)."""

    temperatures: list[float]  # 0 = greedy
    top_ks: list[int]  # -1 = disabled
    top_ps: list[float]
    min_ps: list[float]
    seeds: list[int | None]  # already mixed with the index of the token being sampled
    num_logprobs: list[int | None]  # top-k logprobs to return (None: none)
    processors: list[ProcessorRow | None] | None = None  # None when no row uses any


@dataclass(slots=True)
class PromptLogprobSpan:
    """Prompt logprobs one sequence computes this step: positions [lo, hi) of its prompt, whose logits
    give the logprobs of prompt tokens lo+1 .. hi (see Sequence.prompt_logprob_span)."""

    row: int
    start: int  # index of position lo among the step's tokens
    num_logprobs: int  # top-k per position
    target_ids: list[int]  # prompt tokens lo+1 .. hi (hi - lo of them); read on rank 0 only


@dataclass(slots=True)
class StepBatch:
    is_prefill: bool  # False: every sequence computes exactly its last token (a decode step)
    input_ids: list[int]  # [num_tokens], sequences one after another
    positions: list[int]  # [num_tokens]
    slot_mapping: list[int]  # [num_tokens]
    cu_seqlens_q: list[int]  # [num_seqs + 1]: sequence i's tokens are [cu[i], cu[i + 1])
    seqlens_k: list[int]  # [num_seqs]: context length after this step
    block_tables: list[list[int]]  # [num_seqs][num_blocks]
    sample_rows: list[int]  # sequences whose computation reaches their end: they sample a token
    sampling: SamplingBatch | None  # None on the workers: only rank 0 samples
    # Sequences that compute prompt logprobs this step (prefill only): every rank computes their
    # logits, since the LM head gathers across ranks.
    prompt_logprob_spans: list[PromptLogprobSpan] = field(default_factory=list)
    # Overlap scheduling (rank 0 alone): input tokens the previous step is still sampling. Token
    # prev_token_indices[i] of input_ids is a placeholder that the runner replaces, on the device, by
    # row prev_token_rows[i] of the previous step's sampled ids.
    prev_token_indices: list[int] = field(default_factory=list)
    prev_token_rows: list[int] = field(default_factory=list)
    # Speculative decoding: per sampling row (sample_rows order), the draft tokens it verifies, the last
    # len(drafts) of its input tokens; [] when no row has drafts. A row with n drafts samples at each of
    # its last n + 1 positions (its last token's, then each draft's): logits_indices, the SamplingBatch
    # and StepOutput.token_ids have one entry per position, every rank computes those logits.
    spec_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_k)

    @property
    def logits_indices(self) -> list[int]:
        """The tokens whose hidden states the sampler reads: each sampling row's last, or with drafts
        its last token's and its drafts' positions."""
        cu = self.cu_seqlens_q
        if not self.spec_token_ids:
            return [cu[row + 1] - 1 for row in self.sample_rows]
        return [i for row, drafts in zip(self.sample_rows, self.spec_token_ids, strict=True)
                for i in range(cu[row + 1] - 1 - len(drafts), cu[row + 1])]


@dataclass(slots=True)
class StepOutput:
    """What a step returns on rank 0."""

    # The new token of each sampling row (StepBatch.sample_rows order); with drafts, the token sampled
    # at each verified position (StepBatch.logits_indices order), of which the engine keeps a prefix.
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # per token_ids entry, when some row asked
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None  # batch row -> this step's


def slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of one sequence, one block run at a time."""
    out: list[int] = []
    for i in range(start // block_size, (end + block_size - 1) // block_size):
        base = block_table[i] * block_size - i * block_size
        out.extend(range(base + max(start, i * block_size), base + min(end, (i + 1) * block_size)))
    return out


def _banned_tokens(seq: ScheduledSequence, drafts: tuple[int, ...]) -> list[int]:
    """Tokens a row may not sample now, after the output so far and `drafts` (the drafts before a
    verified position): min_tokens' stop ids, and bad words whose other tokens end that output (a
    one-token bad word is always banned)."""
    banned = []
    if seq.num_completion_tokens + len(drafts) < seq.sampling_params.min_tokens:
        banned.extend(seq.min_tokens_stop_ids)
    output = seq.completion_token_ids + list(drafts) if seq.bad_words_token_ids else []
    for word in seq.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def _processors(seq: ScheduledSequence, drafts: tuple[int, ...] = ()) -> ProcessorRow | None:
    """The row's processors after the output so far and `drafts` (speculative decoding: the drafts
    before the position it verifies); None without processors."""
    if not seq.uses_logits_processors:
        return None
    p = seq.sampling_params
    penalties = ((p.repetition_penalty, p.frequency_penalty, p.presence_penalty) if p.uses_penalties
                 else None)
    # A grammar as it stands after the drafts: the matcher takes them and rolls them back when it fills.
    grammar = DraftedGrammar(seq.grammar, list(drafts)) if drafts and seq.grammar is not None else seq.grammar
    return ProcessorRow(p.allowed_token_ids, _banned_tokens(seq, drafts), p.logit_bias, penalties,
                        seq.token_ids[:seq.num_prompt_tokens] if penalties else [],
                        seq.completion_token_ids + list(drafts) if penalties else [], grammar)


def with_drafts(sampling: SamplingBatch, spec: list[list[int]],
                seqs: list[ScheduledSequence] | None = None) -> SamplingBatch:
    """`sampling` (of `seqs`, which its processors need) with row i repeated for each of its
    1 + len(spec[i]) positions. Position j samples the request's token number num_completion_tokens + j:
    its seed mixes that index in, and its processors (penalties, bad words, min_tokens) take the drafts
    before it as output, as plain decoding would for that token (a seeded request samples the same
    tokens with and without drafts)."""
    counts = [1 + len(drafts) for drafts in spec]

    def repeat(values: list) -> list:
        return [v for v, count in zip(values, counts) for _ in range(count)]

    seeds = [None if seed is None else (seed + j) & SEED_MASK
             for seed, count in zip(sampling.seeds, counts) for j in range(count)]
    processors = None if sampling.processors is None else [
        _processors(seq, tuple(drafts[:j])) for seq, drafts in zip(seqs, spec, strict=True)
        for j in range(1 + len(drafts))]
    return SamplingBatch(repeat(sampling.temperatures), repeat(sampling.top_ks), repeat(sampling.top_ps),
                         repeat(sampling.min_ps), seeds, repeat(sampling.num_logprobs), processors)


def sampling_batch(seqs: list[ScheduledSequence]) -> SamplingBatch:
    """The sampling rows of `seqs`, one per sequence, in order."""
    params = [seq.sampling_params for seq in seqs]
    processors = [_processors(seq) for seq in seqs]
    return SamplingBatch(
        temperatures=[p.temperature for p in params], top_ks=[p.top_k for p in params],
        top_ps=[p.top_p for p in params], min_ps=[p.min_p for p in params],
        seeds=[None if seq.seed is None else (seq.seed * SEED_STRIDE + seq.num_completion_tokens) & SEED_MASK
               for seq in seqs],
        num_logprobs=[p.logprobs for p in params],
        processors=processors if any(row is not None for row in processors) else None)


def build_batch(seqs: list[ScheduledSequence], is_prefill: bool) -> StepBatch:
    """The record of one step over `seqs`, each computing its `num_scheduled_tokens` next tokens.
    Runs once per step on the host, so the common one-token case takes a short path."""
    input_ids, positions, slot_mapping, cu_q, seqlens_k, sample_rows = [], [], [], [0], [], []
    spans: list[PromptLogprobSpan] = []
    num_tokens = 0
    speculates = False
    for row, seq in enumerate(seqs):
        start = seq.num_computed_tokens
        num = seq.num_scheduled_tokens
        end = start + num
        if num == 1:  # a decode token (or a prompt's last): one position, one slot
            block_size = seq.block_size
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slot_mapping.append(seq.block_table[start // block_size] * block_size + start % block_size)
        else:
            if seq.spec_token_ids:  # its last token, then the drafts it verifies
                speculates = True
                input_ids.append(seq.token_ids[start])
                input_ids.extend(seq.spec_token_ids)
            else:
                input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(slots(seq.block_table, start, end, seq.block_size))
        num_tokens += num
        cu_q.append(num_tokens)
        seqlens_k.append(end)
        span = seq.prompt_logprob_span() if is_prefill else None
        if span is not None:
            lo, hi = span
            spans.append(PromptLogprobSpan(row, cu_q[-2] + lo - start, seq.sampling_params.prompt_logprobs,
                                           seq.token_ids[lo + 1:hi + 1]))
        if end >= len(seq):  # the whole sequence is computed (and its drafts): its next token is sampled
            sample_rows.append(row)
    sampled = seqs if len(sample_rows) == len(seqs) else [seqs[row] for row in sample_rows]
    sampling = sampling_batch(sampled)
    spec: list[list[int]] = []
    if speculates:
        spec = [seq.spec_token_ids for seq in sampled]
        sampling = with_drafts(sampling, spec, sampled)
    return StepBatch(is_prefill, input_ids, positions, slot_mapping, cu_q, seqlens_k,
                     [seq.block_table for seq in seqs], sample_rows, sampling, spans, spec_token_ids=spec)
