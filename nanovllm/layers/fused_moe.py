"""Sparse mixture-of-experts block (Qwen3-MoE): a replicated router picks `top_k` of `num_experts`
SiLU-gated experts per token (softmax, top-k, optionally renormalised: `norm_topk_prob`), and the
block returns the routing-weighted sum of those experts' outputs.

Weights are stacked at load: `w13_weight` [E, 2 * I / tp, H] holds each expert's gate rows then up
rows, `w2_weight` [E, H, I / tp] its down projection. Checkpoints name one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, ...) or, as GGUF files read through transformers do, one
stacked tensor per projection (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`);
`MoEExperts.weight_loader` takes both (utils/loader.py maps the names). Tensor parallelism: every
rank holds a slice of every expert's intermediate dimension; the partial outputs are all-reduced
once, where the dense MLP's down projection does it.

Two implementations of the routing and the experts, same math:
- `torch_moe`: loops over the experts that received tokens (the reference, and the CPU path). It
  finds them with `nonzero`, a host sync, so it cannot run inside a CUDA graph.
- On CUDA tensors, Triton kernels: `nanovllm.kernels.moe_routing.topk_softmax` (softmax, top-k and
  renormalisation in one launch) and `nanovllm.kernels.fused_moe.fused_moe` (tokens sorted by expert
  on the device, one grouped GEMM per projection). Their buffers and grids are sized from the number
  of tokens, top_k and num_experts alone, never from the routing, and nothing is read back to the
  host: decode steps replay in CUDA graphs with any routing.

fp8 experts (an FP8 checkpoint's, or `quantization="fp8"`) keep their weights and scales as layers/fp8.py
lays them out. On the CPU they run through its dequantizing reference, per expert (W8A8's rounding of
the activations included: per token, or with a static checkpoint's scale for each expert, as
layers/fp8_static.py rounds dense inputs); on CUDA the grouped GEMMs above read the e4m3 weights and widen
them in registers, the activations unrounded (W8A16, as the dense layers' decode GEMV; a static
checkpoint's experts always so)."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import fp8, fp8_experts
from nanovllm.layers.fp8_static import fp8_static_dequant_linear
from nanovllm.layers.linear import ReplicatedLinear, _divide
from nanovllm.layers.linear_methods import LinearMethod
from nanovllm.layers.norm_act import RMSNorm
from nanovllm.layers.parallel import all_reduce, get_tp_rank, get_tp_size
from nanovllm.utils.config_checks import Fp8Scheme

# Shard ids of the stacked expert weights, as `checkpoint_shapes` and the loader name them.
GATE, UP, DOWN, GATE_UP = "gate", "up", "down", "gate_up"


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, top_k], topk_ids [T, top_k]) from router logits [T, E], as transformers
    computes them: softmax in float32, top-k, renormalised if norm_topk_prob. On CUDA one Triton kernel
    (int32 ids; equal probabilities go to the lower expert id); elsewhere torch (int64 ids)."""
    if router_logits.is_cuda:
        from nanovllm.kernels.moe_routing import topk_softmax
        return topk_softmax(router_logits, top_k, norm_topk_prob)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


# (rows, w13 or w2, expert) -> rows @ that expert's weight^T
ExpertLinear = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, linear: ExpertLinear | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k]; x [T, H],
    w13 [E, 2I, H], w2 [E, H, I]. The loop and the order of the sums follow transformers'. linear: each
    expert's matmul (None: F.linear on its weight)."""
    linear = linear or (lambda rows, w, expert: F.linear(rows, w[expert]))
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for expert in torch.unique(topk_ids).tolist():  # host sync: the experts that received tokens
        token_idx, k_idx = torch.where(topk_ids == expert)
        gate, up = linear(x[token_idx], w13, expert).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w2, expert) * weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y)
    return out


class MoEExperts(nn.Module):
    """The stacked expert weights and their loader; `forward` dispatches to Triton on CUDA. quantization:
    fp8 experts (layers/fp8.py), or None for the model's dtype."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quantization: Fp8Scheme | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = _divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.quantization = quantization
        if quantization is not None:
            fp8_experts.create_expert_weights(self, quantization)
            return
        i = self.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        for param, proj in ((self.w13_weight, "w13"), (self.w2_weight, "w2")):
            param.weight_loader, param.expert_proj = self.weight_loader, proj

    def checkpoint_rows(self, part: str) -> int:
        """The rows of one expert's full (unsharded) checkpoint tensor of `part`."""
        full = self.intermediate_size * self.tp_size
        return {GATE: full, UP: full, GATE_UP: 2 * full, DOWN: self.hidden_size}[part]

    def _checkpoint_cols(self, param: nn.Parameter) -> int:
        """The columns of one expert's full checkpoint tensor that `param` (a weight, or its scales with
        the checkpoint's rows per output row) is loaded from: w2's are split across ranks."""
        split = param.expert_proj == "w2" and getattr(param, "sharded_cols", True)
        return param.shape[2] * (self.tp_size if split else 1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int | None, str]) -> None:
        """shard_id = (expert, part): one expert's [rows, cols] checkpoint tensor, or with expert None
        every expert's, stacked on a leading dim. Parts: gate, up, gate_up ([gate; up] rows), down."""
        expert, part = shard_id
        i, rank, full = self.intermediate_size, self.tp_rank, self.intermediate_size * self.tp_size
        cols = self._checkpoint_cols(param)
        expected = (self.checkpoint_rows(part), cols)
        if expert is None:
            expected = (self.num_experts, *expected)
        elif not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert} but the config has {self.num_experts}")
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint expert tensor ({part}) of shape {tuple(loaded.shape)} does not fit "
                             f"{expected}; is it the model its config describes?")
        if expert is not None:
            loaded = loaded.unsqueeze(0)
        target = param.data if expert is None else param.data[expert : expert + 1]
        if part == DOWN:  # row-parallel: this rank's slice of the input (intermediate) dim
            local = param.shape[2]
            target.copy_(loaded.narrow(2, rank * local, local) if cols != local else loaded)
        elif part == GATE_UP:
            target[:, :i].copy_(loaded.narrow(1, rank * i, i))
            target[:, i:].copy_(loaded.narrow(1, full + rank * i, i))
        else:  # column-parallel: this rank's slice of the output (intermediate) dim
            offset = 0 if part == GATE else i
            target[:, offset : offset + i].copy_(loaded.narrow(1, rank * i, i))

    def checkpoint_parts(self, param: nn.Parameter) -> list[str]:
        """The (expert, part) pieces a checkpoint must provide for `param`, as `expert.part` names:
        the loader reports any that no tensor filled."""
        parts = (DOWN,) if param.expert_proj == "w2" else (GATE, UP)
        return [f"{e}.{p}" for e in range(self.num_experts) for p in parts]

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[tuple[None, str], tuple[int, ...]]:
        """Every expert's full (unsharded) tensor per part, for random weights that do not depend on
        the number of ranks."""
        e, cols = self.num_experts, self._checkpoint_cols(param)
        parts = (DOWN,) if param.expert_proj == "w2" else (GATE, UP)
        return {(None, part): (e, self.checkpoint_rows(part), cols) for part in parts}

    def process_weights_after_loading(self) -> None:
        if self.quantization is not None:
            fp8_experts.process_expert_weights(self, self.quantization)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.quantization is not None:
            return self._fp8_forward(x, topk_weights, topk_ids)
        if x.is_cuda:
            from nanovllm.kernels.fused_moe import fused_moe
            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return torch_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def _fp8_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                     ) -> torch.Tensor:
        g13, g2 = fp8_experts.expert_groups(self, self.quantization)
        w13, w2 = self.w13_weight, self.w2_weight
        static = self.quantization.static_input
        if x.is_cuda:  # the grouped GEMMs read e4m3: widened in registers (W8A16), or W8A8 (moe_config)
            from nanovllm.kernels.fused_moe import fused_moe
            return fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=self.w13_weight_scale,
                             w2_scale=self.w2_weight_scale, scale_groups=(g13, g2), w8a8=not static)
        scales = {id(w13): (self.w13_weight_scale, g13, getattr(self, "w13_input_scale", None)),
                  id(w2): (self.w2_weight_scale, g2, getattr(self, "w2_input_scale", None))}

        def linear(rows: torch.Tensor, weight: torch.Tensor, expert: int) -> torch.Tensor:
            scale, group, inputs = scales[id(weight)]
            if static:
                return fp8_static_dequant_linear(rows, weight[expert], scale[expert], group,
                                                 inputs[expert : expert + 1], None)
            return fp8.fp8_dequant_linear(rows, weight[expert], scale[expert], group, None)

        return torch_moe(x, w13, w2, topk_weights, topk_ids, linear)


class SparseMoeBlock(nn.Module):
    """Router + experts; a drop-in for the dense MLP of a decoder layer (the same calls and results).
    router_method: the router's linear method (None: torch); quantization: the experts' (fp8 or None)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, hidden_act: str = "silu", router_method: LinearMethod | None = None,
                 quantization: Fp8Scheme | None = None) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; only 'silu' is")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and num_experts "
                             f"({num_experts})")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        # The router: every rank routes alike.
        self.gate = ReplicatedLinear(hidden_size, num_experts, quant_method=router_method)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, quantization)
        self.tp_size = self.experts.tp_size

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """self(x); given the RMSNorm before the block, (self(norm(x + residual)), x + residual), or
        without a residual (self(norm(x)), x), as DecoderMLP (the norm runs on its own here: the experts
        need the normed rows themselves)."""
        if norm is None:
            return self._moe(x)
        if residual is None:
            return self._moe(norm(x)), x
        x, residual = norm(x, residual)
        return self._moe(x), residual

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        y = self.experts(x, topk_weights, topk_ids)
        return all_reduce(y) if self.tp_size > 1 else y
