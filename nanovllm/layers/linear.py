"""Tensor-parallel linear layers: how each splits its weight across ranks and loads its shard. Each
parameter carries a `weight_loader(param, loaded[, shard_id])` that copies this rank's shard of a
checkpoint tensor into it; the matmul itself is the layer's method object's (layers/linear_methods.py),
which creates the weight parameters too.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial outputs (at one rank, no call at all)."""

import torch
from torch import nn

from nanovllm.layers.linear_methods import LinearMethod, UnquantizedLinearMethod
from nanovllm.layers.norm_act import RMSNorm, SiluAndMul
from nanovllm.layers.parallel import all_reduce, get_tp_rank, get_tp_size


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class LinearBase(nn.Module):
    """quant_method: how the layer computes (layers/linear_methods.py), chosen by the model's KernelPlan;
    None: dense weights through torch."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _check_shape(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: int | str | None = None) -> None:
        """The whole checkpoint tensor must have its expected shape: copy_ would broadcast one row over
        the weight, and narrow would silently take a prefix of a too-large tensor."""
        expected = self.checkpoint_shapes(param)[shard_id]
        if tuple(loaded.shape) != tuple(expected):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"{tuple(expected)}")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self._check_shape(param, loaded)
        if self.tp_dim is not None and param.dim() > self.tp_dim:
            size = param.shape[self.tp_dim]
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        param.data.copy_(loaded)

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[int | str | None, tuple[int, ...]]:
        """The full (unsharded) checkpoint tensors that `param` is loaded from, by shard id (None when
        the loader takes no shard id), e.g. to make random weights that do not depend on the number
        of ranks."""
        shape = list(param.shape)
        if self.tp_dim is not None and param.dim() > self.tp_dim:
            shape[self.tp_dim] *= self.tp_size
        return {None: tuple(shape)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's matmul alone, without communication (what the GEMM warm-up runs)."""
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (e.g. an MoE router, whose logits every rank needs)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__(input_size, output_size, bias, None, quant_method)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        output_size = _divide(output_size, get_tp_size(), "output size")
        super().__init__(input_size, output_size, bias, 0, quant_method)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """self(x); given the RMSNorm before this layer, (self(norm(x + residual)), x + residual), or
        without a residual (self(norm(x)), x): the norm folded into the matmul where the method can."""
        if norm is None:
            return self.quant_method.apply(self, x, self.bias)
        return self.quant_method.apply_normed(self, x, norm, residual)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        for size in output_sizes:  # each part is split on its own, not just their sum
            _divide(size, get_tp_size(), "output size")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        self._check_shape(param, loaded, shard_id)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[int | str | None, tuple[int, ...]]:
        return {i: (size, *param.shape[1:]) for i, size in enumerate(self.output_sizes)}

    def gated(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A gated MLP's gate/up ([gate; up], two equal parts): (silu(gate) * up of self(x), None), or given
        the norm before it (that of self(norm(x + residual)), x + residual), in one kernel where the method
        has one for x's rows; None where it has not (then self(...) and the SiLU-mul after)."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"a gated projection has two equal parts (gate, up); got {self.output_sizes}")
        return self.quant_method.apply_gated(self, x, norm, residual)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads are split across ranks; K/V heads too, or replicated when
    there are fewer K/V heads than ranks (each rank then keeps the one its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, quant_method: LinearMethod | None = None) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of key/value heads")
            self.kv_head_index = get_tp_rank() * self.num_kv_heads
        else:
            _divide(tp_size, total_num_kv_heads, "tensor_parallel_size over key/value heads")
            self.num_kv_heads = 1
            self.kv_head_index = get_tp_rank() // (tp_size // total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        # ColumnParallelLinear divides by tp_size; hand it the total so the per-rank size comes out.
        LinearBase.__init__(self, hidden_size, output_size, bias, 0, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        self._check_shape(param, loaded, shard_id)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.kv_head_index * self.head_dim
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[int | str | None, tuple[int, ...]]:
        rest = tuple(param.shape[1:])
        kv = (self.total_num_kv_heads * self.head_dim, *rest)
        return {"q": (self.total_num_heads * self.head_dim, *rest), "k": kv, "v": kv}


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__(_divide(input_size, get_tp_size(), "input size"), output_size, bias, 1, quant_method)

    def forward(self, x: torch.Tensor, act: SiluAndMul | None = None) -> torch.Tensor:
        """self(x); given the gated MLP's activation before this layer, self(act(x)) of its [gate | up],
        the SiLU-mul folded into the matmul where the method can. The bias is added once, after the
        partial sums are reduced."""
        if act is None:
            y = self.quant_method.apply(self, x, None)
        else:
            y = self.quant_method.apply_silu(self, x, None)
        if self.tp_size > 1:
            y = all_reduce(y)
        return y if self.bias is None else y + self.bias

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, None)
