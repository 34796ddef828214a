"""MoE routing in one Triton kernel: softmax over the router logits, top-k, optional renormalisation,
as `nanovllm.layers.fused_moe.route` computes it in torch (softmax, topk, divide: four or five
launches, which at decode cost more than the arithmetic).

Each program takes BLOCK_T tokens' rows of logits [BLOCK_T, E_PAD] into registers, and picks the top
k by k rounds of (max, lowest expert id holding it, mask it out): equal probabilities go to the lower
expert id. Output sizes come from the logits' shape alone, so it is CUDA-graph capturable."""

import torch
import triton
import triton.language as tl

# Router logits per program: BLOCK_T x E_PAD float32 values, 32 per thread at 4 warps.
TILE_ELEMENTS = 4096
MIN_BLOCK_T = 1


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [T, E], any float dtype
    topk_weights_ptr,  # [T, TOP_K] float32
    topk_ids_ptr,  # [T, TOP_K] int32
    num_tokens,
    num_experts,
    stride_lt,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_PAD)
    t_mask = tokens < num_tokens
    logits = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * stride_lt + experts[None, :],
                     mask=t_mask[:, None] & (experts < num_experts)[None, :], other=float("-inf"))
    logits = tl.where(t_mask[:, None], logits.to(tl.float32), 0.0)  # rows past T: no -inf - -inf NaNs
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])  # padded experts: exp(-inf) = 0
    probs = p / tl.sum(p, axis=1)[:, None]
    ks = tl.arange(0, K_PAD)
    weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        best_id = tl.min(tl.where(probs == best[:, None], experts[None, :], E_PAD), axis=1)
        weights = tl.where(ks[None, :] == k, best[:, None], weights)
        ids = tl.where(ks[None, :] == k, best_id[:, None], ids)
        probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)  # below every probability
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # padded columns hold 0
    out = tokens[:, None] * TOP_K + ks[None, :]
    mask = t_mask[:, None] & (ks < TOP_K)[None, :]
    tl.store(topk_weights_ptr + out, weights, mask=mask)
    tl.store(topk_ids_ptr + out, ids, mask=mask)


def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k]) from router logits [T, E]."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        raise ValueError("router logits need a contiguous last (expert) dim")
    e_pad = triton.next_power_of_2(num_experts)
    block_t = max(MIN_BLOCK_T, min(TILE_ELEMENTS // e_pad, triton.next_power_of_2(max(num_tokens, 1))))
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
            router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, BLOCK_T=block_t,
            RENORMALIZE=renormalize)
    return weights, ids
