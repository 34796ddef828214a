"""The draft-model proposer (nanovllm.speculative.draft) on its own: with the target itself as the draft,
its proposals are the target's greedy continuation (transformers' greedy on the same weights), through
simulated verifications that keep all, some or none of the drafts, a preemption, and prompts longer
than a step's token budget; the draft's cache bookkeeping is checked step by step. And the draft is
refused when its vocabulary is not the target's."""

import itertools
import json
import shutil

import pytest
import torch
from conftest import PROMPTS, hf_greedy, make_model_dir

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.speculative.draft import DraftModelProposer

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 4  # small, so that drafts and catch-ups cross block boundaries
NUM_BLOCKS = 128
OUTPUT_LEN = 30  # tokens each sequence grows by, verification by verification


def target_config(model: str, k: int, draft: str | None = None, **options) -> Config:
    """On the CPU wherever the tests run: proposals are compared with transformers' float32 greedy tokens
    (on a GPU in bf16 they part at near-ties)."""
    return Config(model, speculative_config={"model": draft or model, "num_speculative_tokens": k},
                  kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=NUM_BLOCKS, max_model_len=128,
                  max_num_seqs=8, cpu_threads=1, device="cpu", **options)


class Blocks:
    """Hands out the target's block ids, as the scheduler would: each sequence's table covers its
    tokens plus the k drafts a verification step computes."""

    def __init__(self) -> None:
        self.free = list(range(NUM_BLOCKS))

    def reserve(self, seq: Sequence, k: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < len(seq) + k:
            seq.block_table.append(self.free.pop(0))

    def preempt(self, seq: Sequence) -> None:
        """What BlockManager.deallocate does, and a new table (other block ids) at re-admission."""
        old, seq.block_table = seq.block_table, []
        seq.num_draft_computed_tokens = 0
        self.free.extend(old)


class Recorder:
    """The draft steps a proposal runs: per step, each row's (start position, number of tokens)."""

    def __init__(self, proposer: DraftModelProposer) -> None:
        self.steps: list[list[tuple[int, int]]] = []
        runner = proposer.runner
        logits, launch = runner.logits, runner.launch

        def record(batch):
            cu = batch.cu_seqlens_q
            self.steps.append([(batch.positions[cu[i]], cu[i + 1] - cu[i]) for i in range(batch.num_seqs)])

        runner.logits = lambda batch, previous=None: record(batch) or logits(batch, previous)  # catch-up
        runner.launch = lambda batch, previous=None: record(batch) or launch(batch, previous)  # one-token


def verify(seq: Sequence, drafts: list[int], expected: list[int], policy: str) -> int:
    """Append what a verification step emits under `policy` and return how many drafts it kept:
    "all" (the drafts and the target's next token), "some" (half of them, then a token the draft did
    not propose), "none" (such a token at once)."""
    keep = {"all": len(drafts), "some": len(drafts) // 2, "none": 0}[policy]
    seq.token_ids.extend(drafts[:keep])
    if keep == len(drafts) and keep < len(expected):
        seq.token_ids.append(expected[keep])
    else:  # a token the target "sampled" instead of the next draft
        seq.token_ids.append((drafts[keep] + 7) % 300 + 3)
    return keep


@pytest.mark.parametrize("k", [1, 3, 5])
def test_proposals_are_the_targets_greedy_continuation(qwen3_dir, hf_qwen3, tokenizer, k):
    proposer = DraftModelProposer(target_config(qwen3_dir, k), NUM_BLOCKS)
    try:
        recorder = Recorder(proposer)
        blocks = Blocks()
        seqs = [Sequence(tokenizer.encode(p), block_size=BLOCK_SIZE) for p in PROMPTS]
        policies = itertools.cycle(["all", "some", "none", "all", "all"])
        # The draft KV each sequence keeps from its previous proposal: None before the first one.
        kept: list[int | None] = [None] * len(seqs)
        preempted = False
        while min(len(seq) - seq.num_prompt_tokens for seq in seqs) < OUTPUT_LEN:
            if not preempted and len(seqs[1]) - seqs[1].num_prompt_tokens > OUTPUT_LEN // 2:
                blocks.preempt(seqs[1])  # its draft KV is gone: it computes everything again
                kept[1], preempted = 0, True
                blocks.reserve(seqs[1], k)
                cache = proposer.runner.kv_cache  # [2, layers, blocks, ...]: stale KV there would show
                cache[:, :, seqs[1].block_table] = torch.randn_like(cache[:, :, seqs[1].block_table])
            for seq in seqs:
                blocks.reserve(seq, k)
            recorder.steps.clear()
            proposals = proposer.propose(seqs, [k] * len(seqs))
            expected = [hf_greedy(hf_qwen3, seq.token_ids, k + 1) for seq in seqs]
            assert proposals == [e[:k] for e in expected]
            # The first step computes, per sequence, what lacked draft KV: from where its kept KV ends
            # through its last token; then k - 1 steps of one token each, at len, len + 1, ...
            assert recorder.steps[0] == [(n or 0, len(seq) - (n or 0)) for n, seq in zip(kept, seqs)]
            assert recorder.steps[1:] == [[(len(seq) + j, 1) for seq in seqs] for j in range(k - 1)]
            assert [seq.num_draft_computed_tokens for seq in seqs] == [len(seq) for seq in seqs]
            policy = next(policies)
            for i, seq in enumerate(seqs):
                length = len(seq)
                keep = verify(seq, proposals[i], expected[i], policy)
                # The fed drafts (the first k - 1) that were kept are still valid draft KV.
                kept[i] = length + min(keep, k - 1)
        assert preempted
    finally:
        proposer.shutdown()


def test_one_token_steps_run_one_ahead_of_the_host_at_most(qwen3_dir, tokenizer):
    """The k - 1 one-token steps feed each other on the device, and the host reads each while the next
    runs, never later: a decode graph's sampled ids alternate between two output slots, so a step left
    unread while two more launched would have its ids overwritten on a GPU."""
    k = 5
    proposer = DraftModelProposer(target_config(qwen3_dir, k), NUM_BLOCKS)
    try:
        runner, events = proposer.runner, []
        launch = runner.launch

        def launched(batch, previous=None):
            pending, wait = launch(batch, previous), None
            events.append("launch")
            wait, pending.wait = pending.wait, lambda: events.append("read") or wait()
            return pending

        runner.launch = launched
        blocks, seqs = Blocks(), [Sequence(tokenizer.encode(p), block_size=BLOCK_SIZE) for p in PROMPTS[:2]]
        for seq in seqs:
            blocks.reserve(seq, k)
        assert [len(p) for p in proposer.propose(seqs, [k, k])] == [k, k]
        # Unread launched steps after each event: one ahead at most, every step read in the end.
        in_flight = list(itertools.accumulate(1 if e == "launch" else -1 for e in events))
        assert events.count("launch") == k - 1 and max(in_flight) <= 2 and in_flight[-1] == 0
        assert events[:3] == ["launch", "launch", "read"]  # the second launched before the first is read
    finally:
        proposer.shutdown()


def test_long_prompts_catch_up_in_steps_of_the_token_budget(qwen3_dir, hf_qwen3, tokenizer):
    proposer = DraftModelProposer(target_config(qwen3_dir, 2, max_num_batched_tokens=8), NUM_BLOCKS)
    try:
        recorder = Recorder(proposer)
        blocks = Blocks()
        seqs = [Sequence(tokenizer.encode(p), block_size=BLOCK_SIZE) for p in PROMPTS]
        for seq in seqs:
            blocks.reserve(seq, 2)
        proposals = proposer.propose(seqs, [2, 1, 0, 2])
        assert proposals[2] == [] and seqs[2].num_draft_computed_tokens == 0  # asked for none
        for i in (0, 1, 3):
            assert proposals[i] == hf_greedy(hf_qwen3, seqs[i].token_ids, 2)[:[2, 1, 0, 2][i]]
        catch_up = recorder.steps[:-1]
        assert all(sum(n for _, n in step) <= 8 for step in catch_up)
        assert sum(n for step in catch_up for _, n in step) == sum(len(seqs[i]) for i in (0, 1, 3))
        assert recorder.steps[-1] == [(len(seqs[0]), 1), (len(seqs[3]), 1)]  # the one-token step
    finally:
        proposer.shutdown()


def test_proposals_stop_where_the_block_table_ends(qwen3_dir, tokenizer):
    proposer = DraftModelProposer(target_config(qwen3_dir, 4), NUM_BLOCKS)
    try:
        seq = Sequence(tokenizer.encode("hello"), block_size=BLOCK_SIZE)
        seq.block_table = [5] * (-(-(len(seq) + 1) // BLOCK_SIZE))  # slots for 2 drafts at most...
        room = len(seq.block_table) * BLOCK_SIZE - len(seq) + 1  # ...or more, at a block's end
        assert len(proposer.propose([seq], [4])[0]) == min(4, room)
    finally:
        proposer.shutdown()


def test_a_draft_of_another_vocabulary_is_refused(qwen3_dir, tmp_path):
    other = str(tmp_path / "other")
    make_model_dir(other, vocab_size=512)  # more ids than the tokenizer: another vocab_size
    with pytest.raises(ValueError, match=r"vocab_size 512 .* has \d+"):
        target_config(qwen3_dir, 3, draft=other)


def test_a_draft_of_another_tokenizer_is_refused(qwen3_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(qwen3_dir, other)
    tokenizer_json = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    a, b = (token for token, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: the same vocab_size
    (other / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(ValueError, match="different tokenizers .* 2 of them"):
        DraftModelProposer(target_config(qwen3_dir, 3, draft=str(other)), NUM_BLOCKS)


def test_the_draft_counts_in_the_kv_cache_budget(qwen3_dir):
    """The draft's KV shares the target's budget (on the CPU, cpu_kvcache_space_gib): a draft as large as
    the target halves the blocks. Its footprint is counted on a meta-device model, without loading it."""
    from nanovllm.runner.kv_cache import draft_footprint
    from nanovllm.runner.model_runner import ModelRunner

    options = dict(kvcache_block_size=BLOCK_SIZE, max_model_len=128, max_num_seqs=8, cpu_threads=1,
                   cpu_kvcache_space_gib=1e-4, device="cpu")  # ~100 KB: 52 blocks of this tiny model's 2 KiB
    runner = ModelRunner(Config(qwen3_dir, **options))
    spec = {"model": qwen3_dir, "num_speculative_tokens": 3}
    with_draft = ModelRunner(Config(qwen3_dir, speculative_config=spec, **options))
    try:
        assert runner.num_kvcache_blocks == 52
        assert with_draft.num_kvcache_blocks == 26
        block, weights = draft_footprint(with_draft.config.draft_config)
        assert block == runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
        model = runner.model
        assert weights == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    finally:
        runner.shutdown()
        with_draft.shutdown()
