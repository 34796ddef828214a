"""N-gram proposals (prompt lookup, vLLM's "ngram" method): find an earlier occurrence of the sequence's
last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that has one (the earliest
occurrence of it, as vLLM picks), and propose the tokens that followed it. Costs no model pass; pays
where outputs repeat their context (code edits, extraction, summaries quoting the input). Pure Python:
the search is bytes.find over the token ids packed 8 bytes each (C speed), and each sequence's packed
ids are kept between steps and only extended (a few microseconds a sequence and step, not the ~15 us
of packing 1,500 ids again)."""

from array import array

from nanovllm.engine.in_flight import PendingTokens
from nanovllm.engine.sequence import PENDING_TOKEN_ID, Sequence

ITEM = 8  # bytes per packed token id


def pack(token_ids: list[int]) -> bytearray:
    return bytearray(array("q", token_ids).tobytes())


def ngram_proposal(token_ids: list[int], min_n: int, max_n: int, k: int, packed: bytes | None = None
                   ) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest tail n-gram
    (min_n <= n <= max_n) of token_ids; [] when none occurs earlier. packed: token_ids packed (`pack`)."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens <= min_n:
        return []
    data = pack(token_ids) if packed is None else packed
    # An earlier occurrence starts at token num_tokens - n - 1 at the latest: it ends before this byte.
    limit = (num_tokens - 1) * ITEM
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        tail = data[(num_tokens - n) * ITEM:]
        at = data.find(tail, 0, limit)
        while at != -1 and at % ITEM:  # a match across token boundaries: look further on
            at = data.find(tail, at + 1, limit)
        if at != -1:
            start = at // ITEM + n
            return token_ids[start:start + k]
    return []


class NgramProposer:
    writes_kv = False
    # A sequence whose last token is still being sampled (overlap scheduling): the lookup runs on the
    # tokens before it and proposes one token more, whose first stands for the pending one (a guess the
    # target checks: a wrong one makes the drafts after it rejected, never the output different).
    guesses_pending = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._packed: dict[int, bytearray] = {}  # seq_id -> its settled token ids packed, as of the last call

    def propose(self, seqs: list[Sequence], num_tokens: list[int], pending: PendingTokens | None = None
                ) -> list[list[int]]:
        """Proposer.propose; a pending last token is guessed from the lookup (`pending` is not read)."""
        packed, out = {}, []
        for seq, k in zip(seqs, num_tokens):
            token_ids = seq.token_ids
            # Settled tokens only grow at the end; the assumed ones may yet be rolled back: packed anew.
            settled = len(token_ids) - seq.num_assumed_tokens
            data = self._packed.get(seq.seq_id)
            num_packed = 0 if data is None else len(data) // ITEM
            if data is None or num_packed > settled:
                data = pack(token_ids[:settled])
            elif num_packed < settled:
                data += array("q", token_ids[num_packed:settled]).tobytes()
            packed[seq.seq_id] = data
            guess = bool(seq.num_assumed_tokens) and token_ids[-1] == PENDING_TOKEN_ID
            context = token_ids[:-1] if guess else token_ids
            if len(context) > settled:
                data = data + array("q", context[settled:]).tobytes()
            proposal = ngram_proposal(context, self.min_n, self.max_n, k + guess, data)
            out.append(proposal[1:] if guess else proposal)
        self._packed = packed  # sequences not asked about this time (finished ones) are forgotten
        return out

    def shutdown(self) -> None:
        self._packed = {}
