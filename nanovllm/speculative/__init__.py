"""Speculative decoding (vLLM's `speculative_config`): a proposer guesses the next few tokens of each
decoding sequence, the target model computes all of them in one forward pass, and the guesses it
would have produced itself are kept, so a step can emit several tokens for the price of one.

    config.py      SpeculativeConfig: the parsed and checked `speculative_config` dict
    proposer.py    the Proposer protocol and make_proposer (n-gram, or the draft model)
    ngram.py       NgramProposer: prompt lookup, the tokens that followed an earlier copy of the tail
    draft.py       DraftModelProposer: a small model of the same vocabulary, greedy
    rejection.py   which drafts a step keeps: the target's own samples, position by position
    decoding.py    the engine's side: who proposes, what a verification step emits, the counters

Pure Python above the draft model: proposals are token ids on the host, and a verification step is an
ordinary StepBatch whose speculating rows compute their last token plus their drafts."""
