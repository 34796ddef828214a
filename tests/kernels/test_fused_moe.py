"""The Triton MoE kernels against the torch path (layers.fused_moe.torch_moe), on CPU tensors through
the Triton interpreter (or on CUDA with TRITON_INTERPRET=0): the expert alignment's layout, and the
fused output for 1, a few and more-than-a-block tokens, empty experts, one expert taking every token,
and routing ties; the one-kernel routing (softmax, top-k, renormalisation) against torch's."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import moe_align as moe_align_module  # noqa: E402
from nanovllm.kernels.fused_moe import MoeConfig, fused_moe, max_num_blocks, moe_align  # noqa: E402
from nanovllm.kernels.moe_align import MAX_SUMMED_CHUNKS  # noqa: E402
from nanovllm.kernels.moe_routing import topk_softmax  # noqa: E402
from nanovllm.layers.fused_moe import route, torch_moe  # noqa: E402

DEVICE = triton_test_device()
# Tiny shapes keep the interpreter fast: H and I are not multiples of the tiles' sizes on purpose.
NUM_EXPERTS, HIDDEN, INTERMEDIATE = 8, 48, 24
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_weights(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def check(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
          config: MoeConfig | None = None, dtype: torch.dtype = torch.float32) -> None:
    w13, w2 = make_weights(dtype=dtype)
    x = x.to(DEVICE, dtype)
    topk_weights, topk_ids = topk_weights.to(DEVICE), topk_ids.to(DEVICE)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, config)
    ref = torch_moe(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert out.dtype == dtype and out.shape == x.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def random_routing(num_tokens: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    topk_weights, topk_ids = route(torch.randn(num_tokens, NUM_EXPERTS, generator=gen), top_k, True)
    return x, topk_weights, topk_ids


# block_s None: one launch; 16: 37 tokens x top-2 = 74 slots in 5 chunks, 13 programs labelling rows,
# each scatter program summing the chunks before its own; 600 tokens: 75 chunks, more than
# MAX_SUMMED_CHUNKS, offset by a scan first (in one tile, or in 16-chunk tiles carrying their sums).
@pytest.mark.parametrize(("block_s", "num_tokens", "scan_block"),
                         [(None, 37, None), (16, 37, None), (16, 600, None), (16, 600, 16)],
                         ids=["one-launch", "chunked", "many-chunks", "many-chunks-scan-tiles"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_groups_slots_by_expert_in_order(block_s: int | None, num_tokens: int,
                                                   scan_block: int | None, block_m: int, monkeypatch):
    if scan_block:
        monkeypatch.setattr(moe_align_module, "SCAN_BLOCK", scan_block)
    # Experts 1 and 6 get no slot.
    gen = torch.Generator().manual_seed(3)
    used = torch.tensor([0, 2, 3, 4, 5, 7])
    topk_ids = torch.stack([used[torch.randperm(6, generator=gen)[:2]] for _ in range(num_tokens)])
    num_slots = topk_ids.numel()
    if num_tokens == 600:
        assert -(-num_slots // block_s) > MAX_SUMMED_CHUNKS
    align = moe_align(topk_ids.to(DEVICE), NUM_EXPERTS, block_m, block_s=block_s)
    sorted_ids, expert_ids = align.sorted_ids.cpu(), align.expert_ids.cpu()
    assert expert_ids.numel() == max_num_blocks(num_slots, NUM_EXPERTS, block_m)
    flat = topk_ids.flatten()
    expected_ids = []
    for expert in range(NUM_EXPERTS):
        slots = torch.nonzero(flat == expert).flatten().tolist()  # in slot order
        num_blocks = -(-len(slots) // block_m)
        expected_ids += [expert] * num_blocks
        rows = [s for s, e in zip(sorted_ids.tolist(), expert_ids.repeat_interleave(block_m).tolist())
                if e == expert]
        assert rows == slots + [num_slots] * (num_blocks * block_m - len(slots)), expert
    real = len(expected_ids)
    assert expert_ids[:real].tolist() == expected_ids
    assert (expert_ids[real:] == -1).all() and (sorted_ids[real * block_m:] == num_slots).all()


@pytest.mark.parametrize("num_tokens", [1, 5, 40])  # 40 tokens x 2: more slots than a block of rows
def test_matches_torch_path(num_tokens: int):
    check(*random_routing(num_tokens, top_k=2, seed=num_tokens))


@pytest.mark.parametrize("config", [MoeConfig(32, 16, 16, num_warps=2, num_stages=2),
                                    MoeConfig(64, 32, 32, num_warps=4, num_stages=3),
                                    MoeConfig(16, 32, 16, swap_ab=True),
                                    MoeConfig(64, 256, 32, num_warps=8, num_stages=3)],
                         ids=["m32", "m64", "swap-ab", "prefill-tiles"])
def test_larger_blocks_and_several_k_tiles(config: MoeConfig):
    check(*random_routing(40, top_k=3, seed=1), config=config)


def test_float16():
    check(*random_routing(12, top_k=2, seed=2), dtype=torch.float16)


def test_empty_experts():
    # Every token picks experts 2 and 5 (in either order); the other six experts get nothing.
    x, topk_weights, _ = random_routing(9, top_k=2)
    topk_ids = torch.tensor([[2, 5], [5, 2]] * 4 + [[2, 5]])
    check(x, topk_weights, topk_ids)


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_one_expert_takes_every_token(num_tokens: int):
    x, _, _ = random_routing(num_tokens, top_k=1)
    topk_ids = torch.full((num_tokens, 1), NUM_EXPERTS - 1)
    check(x, torch.ones(num_tokens, 1), topk_ids)


def test_routing_ties():
    # Equal router logits: every expert ties, top-k keeps the same k experts for every token with
    # equal weights; half the tokens tie only between two experts.
    x, _, _ = random_routing(20, top_k=2)
    logits = torch.zeros(20, NUM_EXPERTS)
    logits[10:, 3] = logits[10:, 6] = 1.0
    topk_weights, topk_ids = route(logits, top_k=2, norm_topk_prob=True)
    assert (topk_weights == 0.5).all()
    assert set(topk_ids[10:].flatten().tolist()) == {3, 6}
    check(x, topk_weights, topk_ids)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize",
                         [(1, 8, 2, True), (37, 8, 3, False), (70, 60, 8, True), (5, 3, 3, True)])
def test_topk_softmax_matches_torch_route(num_tokens: int, num_experts: int, top_k: int, renormalize: bool):
    # 70 tokens x 60 experts: more tokens than one program's rows, a non-power-of-two expert count.
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_tokens))
    weights, ids = topk_softmax(logits.to(DEVICE), top_k, renormalize)
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.cpu().tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-5)


def test_topk_softmax_ties_go_to_the_lower_expert():
    logits = torch.zeros(3, NUM_EXPERTS)
    logits[1, 5] = logits[1, 2] = 1.0  # a tie for the top
    logits[2, 6] = 2.0  # one winner, then a seven-way tie for second place
    weights, ids = topk_softmax(logits.to(DEVICE), 2, True)
    assert ids.cpu().tolist() == [[0, 1], [2, 5], [6, 0]]
    assert weights[0].tolist() == [0.5, 0.5] and weights[1].tolist() == [0.5, 0.5]
