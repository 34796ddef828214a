"""The draft-model proposer (vLLM's `speculative_config={"model": DRAFT, ...}`): a small model with the
target's vocabulary proposes the next k tokens of each decoding sequence by argmax (as vLLM v1's draft
proposers do), which the target then verifies in one forward pass.

The draft runs on a ModelRunner of its own (rank 0's device, one rank, config.draft_config) with its own
paged KV cache of as many blocks as the target's, addressed through the target's block tables: a block
id means the same tokens in both caches. What the draft's cache holds of one sequence of L tokens:

    token ids:  |-- num_draft_computed_tokens --|-- catch-up --| t(L-1) |  x1 .. x(k-1)   |
                  draft KV of tokens that are     computed now, one      fed one by one:
                  still the sequence's            chunk with t(L-1)      positions L .. L+k-2

A proposal computes the catch-up and the last token in one step (the whole prompt the first time,
prefix-cached blocks included: the draft writes the KV they would have into its own cache), takes x1
from the last token's logits, then runs k-1 one-token steps. Where the catch-up is a few tokens a
sequence (after a verification: the kept drafts' last and the target's token) it runs as decode rows in
the draft runner's verification graphs (runner/verify_graphs.py, shaped as a verification whose every
position samples greedily), launched, with x1 fed to the first one-token step on the device; else on
the prefill path, whose attention runs eagerly layer by layer (on an H200 at 0.6B about ten decode
steps' time), read before the one-token steps. The one-token steps run greedy through the runner's
sampler, each launched before the one before it is read: its input comes from that step's sampled id on
the device (StepBatch.prev_token_*, as overlap scheduling feeds decode steps), so the host reads each
step while the device runs the next (the sampler's per-step noise seed is drawn even for greedy rows:
unseeded sampled requests of the target see other random numbers than without a draft, from the same
distribution). The target keeps a prefix of the drafts; of the fed ones, those it kept are still valid
draft KV at the next proposal, the rest are computed again. A preemption frees the blocks and resets
num_draft_computed_tokens (BlockManager.deallocate).

In the overlap loop (engine/overlap.py) a proposal follows a step still in flight: a sequence's last
token is pending (its drafts before it only assumed kept), and the catch-up's last row takes it on the
device from that step's sampled ids (PendingTokens), queued before the step ends. The final step is not
read there (propose's defer_last): each sequence's last draft stays PENDING_TOKEN_ID while the next step
is scheduled and built, the verification takes it on the device from that step's sampled ids
(LastDrafts.feeding, beside the target's own pending tokens), and the host reads it once the verification
is launched, so the device does not idle while the host builds it. Not where a sequence's logits
processors or grammar are built from the drafts' values (engine side: SpeculativeDecoding). The host then
postprocesses the step before while the verification runs. What the draft computed of assumed tokens
stays valid up to the kept drafts: the assumed drafts are the drafts fed, so the next proposal's count
(`_update_computed`) stops where the settled tokens end, before the token the target put in place of a
rejected draft."""

import copy
import weakref

from nanovllm.config import Config
from nanovllm.distributed.worker import threads_per_rank
from nanovllm.engine.in_flight import PendingTokens
from nanovllm.engine.sequence import PENDING_TOKEN_ID
from nanovllm.engine.step import StepBatch
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.speculative.draft_steps import (
    DraftRow,
    DraftSequence,
    LastDrafts,
    draft_batch,
    feed_pending,
    read_step,
)
from nanovllm.utils.tokenizer import load_engine_tokenizer


def check_same_tokenizer(config: Config, draft: Config) -> None:
    """The draft must speak the target's token ids: each token string with the same id in both
    tokenizers (their vocab_size is compared when the Config is built). Raises ValueError otherwise."""
    if config.skip_tokenizer_init:
        return  # token ids in and out: nothing to compare but the vocabulary size
    target_ids = load_engine_tokenizer(config).get_vocab()
    draft_ids = load_engine_tokenizer(draft).get_vocab()
    if target_ids != draft_ids:
        tokens = target_ids.keys() | draft_ids.keys()
        differ = sorted(t for t in tokens if target_ids.get(t) != draft_ids.get(t))
        raise ValueError(f"the draft model {draft.model!r} and the target {config.model!r} have different "
                         f"tokenizers ({len(draft_ids)} and {len(target_ids)} tokens, {len(differ)} of them "
                         f"with other ids or missing, e.g. {differ[:3]}); speculative decoding needs a draft "
                         "with the target's tokenizer (e.g. Qwen3-0.6B as the draft of Qwen3-8B)")


class DraftModelProposer:
    writes_kv = True  # its cache shares the target's block tables (Proposer.writes_kv)
    guesses_pending = True  # a pending last token is fed on the device from the step in flight
    defers_last_draft = True  # propose(defer_last=True): the final step's drafts left on the device

    def __init__(self, config: Config, num_kvcache_blocks: int) -> None:
        draft = config.draft_config
        assert draft is not None, "a draft model proposer needs config.draft_config"
        check_same_tokenizer(config, draft)  # before the weights load: a wrong draft fails fast
        self.block_size = config.kvcache_block_size
        # The draft's cache has the target's block count: the target's block tables address it. (A copy:
        # what the engine computes is never written back into a Config.)
        draft = copy.copy(draft)
        draft.num_kvcache_blocks = num_kvcache_blocks
        # Its runner captures a verification graph set too, sized as the target's (runner/verify_graphs.py):
        # the catch-up steps run there.
        draft.speculative_config = config.speculative_config
        if config.tensor_parallel_size > 1:  # on the CPU, rank 0's share of the cores, as its runner's
            draft.cpu_threads = threads_per_rank(config.tensor_parallel_size)
        self.runner = ModelRunner(draft)
        self.max_model_len = draft.max_model_len  # positions the draft can compute
        self.max_num_batched_tokens = draft.max_num_batched_tokens
        # Per sequence, (n, drafts): the drafts fed at positions n, n + 1, ... by its latest proposal,
        # n its num_draft_computed_tokens then. Weak: a finished sequence's entry goes with it.
        self._fed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.last_drafts: LastDrafts | None = None  # left on the device: latest propose(defer_last=True)

    def propose(self, seqs: list[DraftSequence], num_tokens: list[int], pending: PendingTokens | None = None,
                defer_last: bool = False) -> list[list[int]]:
        """Per sequence, up to num_tokens[i] draft tokens that follow seqs[i].token_ids, each the draft's
        argmax. A sequence gets fewer where its block table or the draft's max_model_len ends first.
        pending: where the overlap loop's step in flight samples the last token of those whose last is
        PENDING_TOKEN_ID; the catch-up takes it on the device. defer_last: the final step is not read;
        its sequences' last draft is PENDING_TOKEN_ID, and `last_drafts` says where it is sampled."""
        self.last_drafts = None
        proposals: list[list[int]] = [[] for _ in seqs]
        wanted: dict[int, int] = {}  # index in seqs -> drafts it can take
        for i, (seq, num) in enumerate(zip(seqs, num_tokens)):
            # The k - 1 fed drafts need slots at positions len(seq) .. len(seq) + num - 2.
            room = min(len(seq.block_table) * self.block_size, self.max_model_len) - len(seq.token_ids) + 1
            num = min(num, room)
            if num > 0:
                wanted[i] = num
                self._update_computed(seq)
        if not wanted:
            return proposals
        order = list(wanted)
        # prev_rows: per sequence, the row of the last launched step whose sampled id is its next input.
        steps, previous, prev_rows = [], None, {}
        launched = self._launch_catch_up([seqs[i] for i in order], pending)
        if launched is None:
            for j, token in self._catch_up([seqs[i] for i in order], pending).items():
                proposals[order[j]].append(token)
        else:
            previous, last_rows = launched
            steps.append((order, previous, last_rows))
            prev_rows = dict(zip(order, last_rows, strict=True))
        # The k - 1 one-token steps, each launched before the one before it is read: a row's input is the
        # previous step's sampled id, taken on the device (StepBatch.prev_token_*, as overlap scheduling
        # feeds decode steps), so the host reads a step while the device runs the next. Never more than
        # that one ahead: a decode graph's sampled ids alternate between two output slots
        # (runner/cuda_graph.py), so a step must be read before the one after the next is launched.
        counts = {i: 1 for i in wanted}
        for _ in range(1, max(wanted.values())):
            active = [i for i, num in wanted.items() if counts[i] < num]
            rows = [DraftRow([PENDING_TOKEN_ID if i in prev_rows else proposals[i][0]],
                             len(seqs[i].token_ids) + counts[i] - 1, seqs[i].block_table, True)
                    for i in active]
            batch = draft_batch(rows, self.block_size, greedy=True)
            for row, i in enumerate(active):
                if i in prev_rows:
                    batch.prev_token_indices.append(row)
                    batch.prev_token_rows.append(prev_rows[i])
            previous = self.runner.launch(batch, previous)
            steps.append((active, previous, None))
            if len(steps) > 1:
                read_step(proposals, *steps.pop(0))
            prev_rows = {i: row for row, i in enumerate(active)}
            for i in active:
                counts[i] += 1
        if defer_last and steps:  # the verification takes them on the device; the host reads them after
            active, last_step, rows = steps.pop()
            rows = rows or range(len(active))
            self.last_drafts = LastDrafts(last_step, {seqs[i].seq_id: row for i, row in zip(active, rows)},
                                          [seqs[i] for i in active])
            for i in active:
                proposals[i].append(PENDING_TOKEN_ID)
        for step in steps:
            read_step(proposals, *step)
        for i in wanted:  # what the next proposal finds of these in the draft's cache
            seq = seqs[i]
            self._fed[seq] = (len(seq.token_ids), proposals[i][:-1])
        return proposals

    def _update_computed(self, seq: DraftSequence) -> None:
        """Count the drafts fed by the previous proposal that the sequence kept; never the last token,
        whose logits the proposal needs."""
        n = seq.num_draft_computed_tokens
        start, fed = self._fed.pop(seq, (-1, []))
        if n and n == start:  # no preemption since (it would have reset n to 0)
            last = len(seq.token_ids) - 1
            for token in fed:
                if n >= last or seq.token_ids[n] != token:
                    break
                n += 1
        seq.num_draft_computed_tokens = min(n, len(seq.token_ids) - 1)

    def _launch_catch_up(self, seqs: list[DraftSequence], pending: PendingTokens | None
                         ) -> tuple[object, list[int]] | None:
        """Launch the catch-up of every sequence as one step of decode rows in the verification graphs:
        (the step, per sequence the row whose sampled id is its first draft); None where it does not fit
        them (then _catch_up computes it on the prefill path)."""
        graphs = self.runner.verify_graphs
        if graphs is None or not graphs.can_run(sum(len(s.token_ids) - s.num_draft_computed_tokens
                                                     for s in seqs)):
            return None
        rows = [DraftRow(seq.token_ids[seq.num_draft_computed_tokens:], seq.num_draft_computed_tokens,
                         seq.block_table, True) for seq in seqs]
        batch = draft_batch(rows, self.block_size, every_position=True)
        launched = self.runner.launch(batch, feed_pending(batch, seqs, rows, pending))
        last_rows, end = [], 0
        for seq, row in zip(seqs, rows, strict=True):
            seq.num_draft_computed_tokens = len(seq.token_ids)
            end += len(row.input_ids)
            last_rows.append(end - 1)
        return launched, last_rows

    def _catch_up(self, seqs: list[DraftSequence], pending: PendingTokens | None) -> dict[int, int]:
        """Compute each sequence's tokens that lack draft KV, its last one included, in steps of at most
        max_num_batched_tokens tokens (the target's chunk size: the activations the memory budget
        allowed for). Returns {index in seqs: the argmax after its last token}."""
        left = list(range(len(seqs)))
        first: dict[int, int] = {}
        while left:
            rows, row_seqs, budget = [], [], self.max_num_batched_tokens
            for i in left:
                seq = seqs[i]
                start = seq.num_draft_computed_tokens
                end = min(len(seq.token_ids), start + budget)
                if end == start:
                    break
                rows.append(DraftRow(seq.token_ids[start:end], start, seq.block_table,
                                     end == len(seq.token_ids)))
                row_seqs.append(i)
                budget -= end - start
            batch = draft_batch(rows, self.block_size)
            sampled = iter(self._argmax(batch, feed_pending(batch, [seqs[i] for i in row_seqs], rows,
                                                             pending)))
            for row, i in zip(rows, row_seqs):
                seqs[i].num_draft_computed_tokens = row.start + len(row.input_ids)
                if row.samples:
                    first[i] = next(sampled)
            left = [i for i in left if i not in first]
        return first

    def _argmax(self, batch: StepBatch, previous: object = None) -> list[int]:
        logits = self.runner.logits(batch, previous)
        return logits.argmax(dim=-1).tolist()

    def shutdown(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.shutdown()
