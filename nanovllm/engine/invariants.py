"""The scheduler's and block manager's invariants, checked in one call: for property tests and the
soak test (scripts/soak.py), after every step. Pure Python; raises AssertionError naming what broke.

- every block's ref_count is the number of queued sequences whose block table holds it;
- the free list is exactly the unreferenced blocks, so free + used == total;
- every cached hash maps to a block that carries that hash, and a block a sequence holds under a
  computed hash carries that sequence's token ids for it;
- a waiting sequence holds no blocks, a running one holds enough for its computed tokens, and no
  sequence is queued twice."""

from collections import Counter

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import SequenceStatus


def check_invariants(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    queued = [*scheduler.waiting, *scheduler.running]
    ids = Counter(seq.seq_id for seq in queued)
    twice = [seq_id for seq_id, n in ids.items() if n > 1]
    assert not twice, f"sequences queued twice: {twice}"
    assert len(scheduler.running) <= scheduler.max_num_seqs, "more running sequences than max_num_seqs"
    holders = Counter(block_id for seq in queued for block_id in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], (
            f"block {block.block_id} has ref_count {block.ref_count} but {holders[block.block_id]} holders")
    free = set(bm.free_blocks)
    assert len(free) == len(bm.free_blocks), "a block is on the free list twice"
    unreferenced = {block.block_id for block in bm.blocks if block.ref_count == 0}
    assert free == unreferenced, f"free list {sorted(free)} != unreferenced blocks {sorted(unreferenced)}"
    used = sum(1 for block in bm.blocks if block.ref_count > 0)
    assert bm.num_free_blocks + used == len(bm.blocks), "free + used != total"
    for h, block_id in bm.hash_to_block.items():
        block = bm.blocks[block_id]
        assert block.hash == h, f"hash {h:x} maps to block {block_id}, which carries {block.hash}"
        assert len(block.token_ids) == bm.block_size, f"cached block {block_id} is not full"
    for seq in scheduler.waiting:
        assert seq.status == SequenceStatus.WAITING, f"sequence {seq.seq_id} waits with status {seq.status}"
        assert not seq.block_table, f"waiting sequence {seq.seq_id} holds blocks {seq.block_table}"
    for seq in scheduler.running:
        assert seq.status == SequenceStatus.RUNNING, f"sequence {seq.seq_id} runs with status {seq.status}"
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens, (
            f"sequence {seq.seq_id} computed {seq.num_computed_tokens} tokens into "
            f"{len(seq.block_table)} blocks")
        assert seq.num_computed_tokens <= len(seq), f"sequence {seq.seq_id} computed beyond its tokens"
        for i, h in enumerate(seq.block_hashes):
            block = bm.blocks[seq.block_table[i]]
            assert block.hash == h and block.token_ids == seq.block(i), (
                f"block {block.block_id} (block {i} of sequence {seq.seq_id}) does not hold its tokens")
