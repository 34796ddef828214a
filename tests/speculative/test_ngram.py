"""Prompt lookup: the longest tail n-gram within the bounds, its earliest earlier occurrence, and the
tokens that followed it."""

from nanovllm.engine.sequence import PENDING_TOKEN_ID, Sequence
from nanovllm.speculative.ngram import NgramProposer, ngram_proposal, pack


def test_proposes_what_followed_the_tail_before():
    assert ngram_proposal([1, 2, 3, 4, 1, 2], 1, 3, 3) == [3, 4, 1]
    assert ngram_proposal([1, 2, 3, 4, 1, 2], 1, 3, 1) == [3]
    assert ngram_proposal([1, 2, 3, 4, 5], 1, 3, 3) == []  # the tail never occurred before


def test_the_longest_n_gram_wins_then_the_earliest_occurrence():
    # [2, 3] occurs at 1 and 5; the 3-gram [1, 2, 3] only at 0: it wins, followed by 9.
    assert ngram_proposal([1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3], 1, 3, 2) == [9, 7]
    # Only 2-grams: [2, 3] first occurs at 1 (followed by 9), later at 5 (followed by 8).
    assert ngram_proposal([5, 2, 3, 9, 7, 2, 3, 8, 4, 2, 3], 2, 3, 2) == [9, 7]
    # min_n = 3: no 3-gram repeats, so nothing.
    assert ngram_proposal([5, 2, 3, 9, 7, 2, 3], 3, 3, 2) == []


def test_overlapping_occurrences_and_runs():
    assert ngram_proposal([7, 7, 7, 7], 1, 2, 3) == [7, 7]  # [7, 7] at 0, followed by the rest
    assert ngram_proposal([4, 7], 1, 2, 3) == []


def test_matches_only_on_token_boundaries():
    # Packed 8 bytes a token, 256 then 1 holds the byte pattern of a 1 one byte off; never a match.
    assert ngram_proposal([256, 1, 0, 0, 0, 0, 0, 0, 0, 1], 1, 1, 2) == [0, 0]
    assert ngram_proposal([1 << 8, 5, 1], 1, 1, 2) == []


def test_proposer_takes_sequences_and_limits():
    proposer = NgramProposer(1, 2)
    a, b = Sequence([1, 2, 3, 1, 2]), Sequence([9, 8])
    assert proposer.propose([a, b], [2, 3]) == [[3, 1], []]
    proposer.shutdown()


def test_packed_ids_follow_the_sequence_between_calls():
    proposer = NgramProposer(1, 2)
    seq = Sequence([1, 2, 3, 4])
    assert proposer.propose([seq], [2]) == [[]]
    seq.token_ids += [1, 2]  # grown since the last call: only the new ids are packed
    assert proposer.propose([seq], [2]) == [[3, 4]]
    assert bytes(proposer._packed[seq.seq_id]) == bytes(pack([1, 2, 3, 4, 1, 2]))
    other = Sequence([5, 5])
    assert proposer.propose([other], [1]) == [[5]]
    assert list(proposer._packed) == [other.seq_id]  # seq was not asked about: forgotten


def test_a_pending_last_token_is_guessed_and_assumed_tokens_are_not_kept_packed():
    """Overlap scheduling: the last token is pending and the two drafts before it only assumed. The
    lookup runs on the tokens before the pending one and proposes one more, the first standing for it;
    only the settled tokens stay packed, so a rollback of the assumed ones leaves no stale bytes."""
    proposer = NgramProposer(1, 2)
    seq = Sequence([1, 2, 3, 4, 5, 1, 2])
    seq.token_ids += [3, 4, PENDING_TOKEN_ID]  # drafts 3, 4 assumed accepted, then the pending token
    seq.num_assumed_tokens = 3
    # ... 1 2 3 4 looked up: 5 followed it (the guess of the pending token), then 1 2.
    assert proposer.propose([seq], [2]) == [[1, 2]]
    assert bytes(proposer._packed[seq.seq_id]) == bytes(pack([1, 2, 3, 4, 5, 1, 2]))
    del seq.token_ids[7:]  # the drafts rejected: the target's token 9 instead
    seq.token_ids.append(9)
    seq.num_assumed_tokens = 0
    assert proposer.propose([seq], [2]) == [[]]  # no 9 earlier: nothing, as a fresh proposer finds
    assert bytes(proposer._packed[seq.seq_id]) == bytes(pack([1, 2, 3, 4, 5, 1, 2, 9]))
