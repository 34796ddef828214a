"""LLM(target, speculative_config={"model": DRAFT, ...}) end to end: greedy output is plain greedy output,
token for token; with the target itself as the draft every draft is accepted, with another random draft
(of the same tokenizer) hardly any, and preemptions (a small KV cache) change neither."""

import pytest
from conftest import PROMPTS, make_model_dir
from test_verify_graphs import with_verify_graphs

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

# Small blocks and few of them: sequences preempt each other, and drafts cross block boundaries.
# float32 on a GPU too, where the engine's default is bfloat16 (greedy tokens equal only in float32)
OPTIONS = dict(kvcache_block_size=4, num_kvcache_blocks=24, max_model_len=256,
               cpu_threads=1, dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        outputs = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.stats().num_preemptions > 0
    return outputs


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Another random model with the same tokenizer, smaller: its greedy tokens are not the target's."""
    path = str(tmp_path_factory.mktemp("draft"))
    make_model_dir(path, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return path


@pytest.mark.parametrize("k", [1, 3])
def test_the_target_as_its_own_draft_is_always_right(qwen3_dir, plain, k):
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": k}
    with LLM(qwen3_dir, speculative_config=spec_config, **OPTIONS) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    spec = stats.spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.num_accepted_tokens_per_pos[0] == spec.num_drafts


def test_another_draft_leaves_greedy_output_unchanged(qwen3_dir, plain, other_draft):
    spec_config = {"model": other_draft, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, speculative_config=spec_config, **OPTIONS) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens // 4


def test_under_tensor_parallelism_the_draft_runs_whole_beside_rank_0(qwen3_dir, plain, other_draft):
    """TP=2 (rank 1 in a spawned process, gloo): the draft runs unsharded in rank 0's process, and the
    KV budget counts its whole cache on rank 0: the target's half (per rank) and the draft's."""
    # On the CPU wherever it runs: the budget checked is the CPU's (1 MiB a rank)
    options = dict(OPTIONS, num_kvcache_blocks=None, cpu_kvcache_space_gib=2**-10, device="cpu")
    spec_config = {"model": other_draft, "num_speculative_tokens": 3}
    with LLM(qwen3_dir, tensor_parallel_size=2, speculative_config=spec_config, **options) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        assert llm.engine.stats().spec_decode.num_draft_tokens > 0
        draft = llm.engine._spec.proposer.runner
        target_block = 2 * 2 * 1 * 16 * 4 * 4  # k and v, 2 layers, 1 of the 2 KV heads, head_dim 16, fp32
        draft_block = draft.kv_cache[:, :, 0].numel() * 4  # 1 layer, both KV heads
        assert draft_block == 2 * 1 * 2 * 16 * 4 * 4
        assert llm.engine.num_kvcache_blocks == 2**20 // (target_block + draft_block)


def test_drafts_cross_block_boundaries_whole(qwen3_dir):
    """The engine gives a sequence slots for its drafts before the draft model writes KV there, so a
    proposal near a block's end is not cut short: one request with blocks to spare gets k drafts at every
    step but those max_tokens clips (its last)."""
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": 3}
    options = dict(OPTIONS, num_kvcache_blocks=64)
    with LLM(qwen3_dir, speculative_config=spec_config, **options) as llm:
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=41, ignore_eos=True))
        spec = llm.engine.stats().spec_decode
    # 41 tokens: the prefill's first, then 10 steps of 3 accepted drafts and a bonus token.
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (10, 30, 30)


@pytest.mark.parametrize("k", [1, 3])
def test_catch_ups_run_as_decode_rows_in_the_drafts_verification_graphs(qwen3_dir, plain, k):
    """After a verification a sequence's draft catches up on a few tokens: as decode rows in the draft
    runner's verification graph set (here run eagerly: the CPU has no CUDA graphs), launched, with its
    first draft fed to the next step on the device. Output and acceptance are the prefill path's."""
    spec_config = {"model": qwen3_dir, "num_speculative_tokens": k}
    with LLM(qwen3_dir, speculative_config=spec_config, **OPTIONS) as llm:
        staged = with_verify_graphs(llm.engine._spec.proposer.runner, 8)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)] == plain
        stats = llm.engine.stats()
    spec = stats.spec_decode
    assert stats.num_preemptions > 0 and spec.num_accepted_tokens == spec.num_draft_tokens > 0
    # Several sequences' catch-ups in one step, each of a few rows; prompts (longer) took the prefill path.
    assert staged and max(staged) > 1 and max(staged) <= 8
