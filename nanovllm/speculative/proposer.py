"""The proposer protocol: what the engine asks of an n-gram lookup or a draft model. Proposals are
deterministic (prompt lookup; the draft model's argmax, as vLLM v1's proposers are), so verification
treats each draft as certain (a one-hot draft distribution; rejection.py)."""

from typing import Protocol

from nanovllm.config import Config
from nanovllm.engine.in_flight import PendingTokens
from nanovllm.engine.sequence import Sequence


class Proposer(Protocol):
    # Whether proposing writes KV at the drafts' positions (a draft model's own cache, addressed through
    # the target's block table): the engine then gives each sequence slots for its drafts first.
    writes_kv: bool
    # Whether it proposes for a sequence whose last token is still being sampled (PENDING_TOKEN_ID, with
    # the drafts before it only assumed accepted: Sequence.num_assumed_tokens), so that verification
    # steps can run in the overlap loop (nanovllm.engine.overlap): n-gram lookup guesses the token, a
    # draft model takes it on the device (`pending`). Optional; False when absent.
    guesses_pending: bool
    # Whether propose(..., defer_last=True) may leave each sequence's last draft on the device
    # (PENDING_TOKEN_ID, fed to the verification there; `last_drafts` says where, and reads them): a draft
    # model's final step, not waited for before the verification is launched. Optional; False when absent.
    defers_last_draft: bool

    def propose(self, seqs: list[Sequence], num_tokens: list[int], pending: PendingTokens | None = None
                ) -> list[list[int]]:
        """Per sequence, up to num_tokens[i] draft token ids that follow seqs[i].token_ids ([]: none).
        pending: where the step in flight samples the sequences' pending last tokens, if any has one.
        (With defers_last_draft, also a keyword defer_last.)"""
        ...

    def shutdown(self) -> None:
        """Free what the proposer holds (a draft model and its KV cache). Idempotent."""
        ...


def make_proposer(config: Config, num_kvcache_blocks: int) -> Proposer | None:
    """The proposer config.speculative_config asks for; None without speculation."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        from nanovllm.speculative.ngram import NgramProposer
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    try:  # torch and a model: imported only when a draft model is asked for
        from nanovllm.speculative.draft import DraftModelProposer
    except ImportError as e:
        if e.name != "nanovllm.speculative.draft":
            raise
        raise NotImplementedError("speculative_config with a draft 'model' is not implemented yet; use "
                                  "{'method': 'ngram', ...}") from None
    return DraftModelProposer(config, num_kvcache_blocks)
