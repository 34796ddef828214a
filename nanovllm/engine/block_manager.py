"""Block manager: maps each sequence to fixed-size KV blocks and shares full blocks between
sequences with the same prefix. A full block is identified by a chained xxhash of its token ids
(and the ids themselves are compared on a hit, so a hash collision never serves wrong KV). Blocks of
finished sequences stay in the prefix cache until their memory is needed (LRU). Pure Python."""

from array import array
from collections import OrderedDict

import xxhash

from nanovllm.engine.sequence import Sequence


def chain_hash(token_ids: list[int], prev_hash: int | None) -> int:
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently freed first: the next allocation evicts from the front.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_cache_hit_tokens = 0  # lifetime counter, for stats and tests

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) that hold a prefix of seq. The last token is never served
        from the cache: its logits are needed, so at least one token is always computed. Neither is
        any token of a sequence that still needs prompt logprobs: they need every position's logits."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return [], []
        hits, hashes, prev = [], [], None
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block(i)
            prev = chain_hash(tokens, prev)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            hashes.append(prev)
        return hits, hashes

    def _num_blocks_to_take(self, seq: Sequence, hits: list[int]) -> int:
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return seq.num_blocks - len(hits) + revived

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._prefix_hits(seq)
        return self._num_blocks_to_take(seq, hits) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        hits, hashes = self._prefix_hits(seq)
        if self._num_blocks_to_take(seq, hits) > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks for sequence {seq.seq_id}; call can_allocate first")
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(seq.num_blocks - len(hits))]
        seq.block_hashes = hashes
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.num_cache_hit_tokens += seq.num_cached_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, []
        block.ref_count = 1
        return block_id

    def append_slot(self, seq: Sequence, num_extra: int = 0) -> bool:
        """Make seq's block table cover all its tokens before a decode step (one block at most: only
        its last token lacks KV), and num_extra slots beyond them (the drafts a speculative step
        verifies). False, changing nothing, when blocks are needed and too few are free."""
        num_needed = -(-(len(seq.token_ids) + num_extra) // self.block_size) - len(seq.block_table)
        if num_needed <= 0:
            return True
        if num_needed > len(self.free_blocks):
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(num_needed))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed KV, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            tokens = seq.block(i)
            h = chain_hash(tokens, seq.block_hashes[-1] if seq.block_hashes else None)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block.setdefault(h, block.block_id)

    def deallocate(self, seq: Sequence) -> None:
        # Free the tail first so that, under memory pressure, a prefix outlives its continuations.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed while unreferenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0  # num_cached_tokens stays: it reports the last admission
        seq.num_draft_computed_tokens = 0  # the draft model's cache is recomputed with the target's
