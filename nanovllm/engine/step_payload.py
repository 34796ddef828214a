"""What rank 0 sends the tensor-parallel workers each step, so that they build the very model inputs
rank 0 builds, without shipping whole Sequence objects.

Per scheduled sequence: the position of its first scheduled token, the scheduled token ids, its
length and its block table. A decode step thus sends one token id per sequence; a prefill step sends
only the chunk being computed, never the cached prefix:

    token ids:  |---- num_computed_tokens ----|---- scheduled (sent) ----|---- later chunks ----|
                                              ^ start                    ^ end         len(seq) ^

Workers never sample, so sampling parameters stay on rank 0."""

from nanovllm.engine.sequence import Sequence

# (start, scheduled token ids, len(seq), block table, prompt logprob span or None)
SeqPayload = tuple[int, list[int], int, list[int], tuple[int, int] | None]
StepPayload = tuple[bool, list[SeqPayload]]  # (is_prefill, sequences)


def pack_step(seqs: list[Sequence], is_prefill: bool) -> StepPayload:
    packed = []
    for seq in seqs:
        start = seq.num_computed_tokens
        packed.append((start, seq.token_ids[start:start + seq.num_scheduled_tokens], len(seq),
                       seq.block_table, seq.prompt_logprob_span()))
    return is_prefill, packed


def unpack_step(payload: StepPayload, block_size: int) -> tuple[list["StepSequence"], bool]:
    """The arguments of ModelRunner.run, as rank 0 called it."""
    is_prefill, packed = payload
    return [StepSequence(*seq, block_size) for seq in packed], is_prefill


class TokenWindow:
    """The scheduled slice of a sequence's token ids, indexed by absolute position like the full list
    (`window[start:end]`, `window[-1]`), which is all that building model inputs reads."""

    __slots__ = ("start", "tokens", "length")

    def __init__(self, start: int, tokens: list[int], length: int) -> None:
        self.start, self.tokens, self.length = start, tokens, length

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            lo, hi, step = key.indices(self.length)
            assert step == 1 and self.start <= lo and hi <= self.start + len(self.tokens), (
                f"tokens [{lo}:{hi}] read outside the scheduled window "
                f"[{self.start}:{self.start + len(self.tokens)}]")
            return self.tokens[lo - self.start:hi - self.start]
        index = key + self.length if key < 0 else key
        assert self.start <= index < self.start + len(self.tokens), (
            f"token {index} read outside the scheduled window [{self.start}:{self.start + len(self.tokens)}]")
        return self.tokens[index - self.start]

    def __len__(self) -> int:
        return self.length


class StepSequence:
    """A worker's stand-in for a scheduled Sequence: the attributes that prepare_prefill and
    prepare_decode read, and nothing else (touching anything more fails loudly)."""

    __slots__ = ("num_computed_tokens", "num_scheduled_tokens", "token_ids", "block_table", "block_size",
                 "span")

    def __init__(self, start: int, tokens: list[int], length: int, block_table: list[int],
                 span: tuple[int, int] | None, block_size: int) -> None:
        self.num_computed_tokens, self.num_scheduled_tokens = start, len(tokens)
        self.token_ids = TokenWindow(start, tokens, length)
        self.block_table, self.block_size, self.span = block_table, block_size, span

    def prompt_logprob_span(self) -> tuple[int, int] | None:
        """Rank 0's span: the worker computes the same logits rows (the LM head's gather is collective)."""
        return self.span

    def __len__(self) -> int:
        return len(self.token_ids)
