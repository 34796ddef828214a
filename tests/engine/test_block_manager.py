from nanovllm.engine import block_manager as bm_module
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence


def seq_of(tokens, block_size=4):
    return Sequence(tokens, block_size=block_size)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model computed every token's KV."""
    seq.num_computed_tokens = len(seq)
    bm.cache_computed_blocks(seq)


def test_allocate_takes_lowest_free_blocks_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(10)))
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert a.num_cached_tokens == 0


def test_prefix_blocks_are_shared_only_after_they_are_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq_of(list(range(10))), seq_of(list(range(8)) + [99, 98])
    bm.allocate(a)
    compute_all(bm, a)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]  # two full blocks shared
    assert b.block_table[2] == 3
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 4


def test_uncomputed_blocks_are_not_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq_of(list(range(10))), seq_of(list(range(10)))
    bm.allocate(a)  # KV not computed yet
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(8)))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(list(range(8)))  # exactly two full cached blocks
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the second block is recomputed to get the last token's logits
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of(list(range(8)))
    bm.allocate(a)
    compute_all(bm, a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    assert [b.ref_count for b in bm.blocks] == [0, 0, 0, 0]
    b = seq_of(list(range(4)) + [7, 7, 7, 7, 7])  # shares block 0 with a
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[0] == 0 and b.num_cached_tokens == 4
    # fresh blocks come from never-hashed blocks first (2, 3), then the least recently freed (1)
    assert b.block_table[1:] == [2, 3]
    c = seq_of([50, 51, 52])
    bm.allocate(c)
    assert c.block_table == [1]
    assert a.block_hashes == [] and bm.blocks[1].hash is None  # block 1 was evicted from the cache


def test_hash_collision_never_serves_wrong_kv(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda tokens, prev: 42)
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of([9, 9, 9, 9, 5])  # same (fake) hash, different tokens
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert b.block_table[0] != a.block_table[0]


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(list(range(9)))
    bm.allocate(a)
    compute_all(bm, a)
    bm.deallocate(a)
    b = seq_of(list(range(9)))  # hits 2 cached (free) blocks, needs 1 more: all 3 are needed
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(seq_of([1]))


def test_append_slot_grows_by_one_block_at_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of([1, 2, 3, 4])
    bm.allocate(a)
    a.token_ids.append(5)
    assert bm.append_slot(a)
    assert a.block_table == [0, 1]
    a.token_ids.append(6)
    assert bm.append_slot(a)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 2


def test_append_slot_refuses_without_a_free_block_and_changes_nothing():
    bm = BlockManager(num_blocks=1, block_size=4)
    a = seq_of([1, 2, 3, 4])
    bm.allocate(a)
    a.token_ids.append(5)
    assert not bm.append_slot(a)
    assert a.block_table == [0] and bm.num_free_blocks == 0


def test_deallocate_frees_everything_and_nothing_leaks():
    bm = BlockManager(num_blocks=6, block_size=2)
    seqs = [seq_of([1, 2, 3, 4, 5], block_size=2), seq_of([1, 2, 3, 9], block_size=2)]
    bm.allocate(seqs[0])
    compute_all(bm, seqs[0])
    bm.allocate(seqs[1])
    for s in seqs:
        bm.deallocate(s)
    assert bm.num_free_blocks == 6
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_caching_disabled_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = seq_of(list(range(10))), seq_of(list(range(10)))
    bm.allocate(a)
    compute_all(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and a.block_hashes == []
