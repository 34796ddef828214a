"""Tensor-parallel linear layers. Each parameter carries a `weight_loader(param, loaded[, shard_id])`
that copies this rank's shard of a checkpoint tensor into it.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial outputs."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.options import kernel_options
from nanovllm.layers.parallel import all_reduce, get_tp_rank, get_tp_size

# A one-token matmul (single-stream decode) is a weight-streaming GEMV, where cuBLAS reaches a third
# to two thirds of the memory bandwidth; nanovllm.kernels.skinny_gemm streams it 1.1-3.7x faster on an
# H200. From 2 to SKINNY_MAX_TOKENS tokens (decode at a few sequences) nanovllm.kernels.skinny_rows
# streams the weight once on tensor cores, except that up to GEMV_MAX_ROWS tokens the plain and the
# SiLU-mul-folded matmuls (o_proj, down_proj) take nanovllm.kernels.gemv_rows, the GEMV for a few rows,
# faster there (its docstring). The one-row GEMV and the rows kernel fold the RMSNorm before a layer
# into them, the GEMVs the SiLU-mul. Config(skinny_gemm=False) turns them off.
SKINNY_MAX_TOKENS = 16
GEMV_MAX_ROWS = 2
SKINNY_DTYPES = (torch.bfloat16, torch.float16)
# Where the kernels run (tests add the CPU, where Triton's interpreter runs them).
SKINNY_DEVICE_TYPES = ("cuda",)


@dataclass(frozen=True, slots=True)
class SkinnyKernels:
    """The Triton kernels this engine's few-token matmuls take (GPU only: imported when called), with
    the options fixed when the layer was built."""

    pdl: bool  # launched as programmatic dependents (sm_90+)
    max_tokens: int

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x's matmul runs here (0 to max_tokens rows of a half-precision CUDA tensor)."""
        return (x.device.type in SKINNY_DEVICE_TYPES and x.dim() == 2 and x.shape[0] <= self.max_tokens
                and x.dtype in SKINNY_DTYPES)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the RMSNorm before a linear layer folds into its kernel."""
        return self.takes(x) and x.shape[0] >= 1 and x.is_contiguous()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= 1:
            from nanovllm.kernels.skinny_gemm import skinny_linear
            return skinny_linear(x, weight, bias, pdl=self.pdl)
        if x.shape[0] <= GEMV_MAX_ROWS:
            from nanovllm.kernels.gemv_rows import gemv_rows_linear
            return gemv_rows_linear(x, weight, bias, pdl=self.pdl)
        from nanovllm.kernels.skinny_rows import rows_linear
        return rows_linear(x, weight, bias, pdl=self.pdl)

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] == 1:
            from nanovllm.kernels.skinny_gemm import skinny_norm_linear
            return skinny_norm_linear(x, norm_weight, eps, weight, bias, residual, self.pdl)
        from nanovllm.kernels.skinny_rows import rows_norm_linear
        return rows_norm_linear(x, norm_weight, eps, weight, bias, residual, self.pdl)

    def folds_silu(self, x: torch.Tensor) -> bool:
        """Whether the SiLU-mul before a linear layer folds into its kernel: up to GEMV_MAX_ROWS rows (in
        the rows kernel it measured slower than its own kernel, skinny_rows)."""
        return self.fuses(x) and x.shape[0] <= GEMV_MAX_ROWS

    def silu_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            from nanovllm.kernels.skinny_gemm import skinny_silu_linear
            return skinny_silu_linear(x, weight, pdl=self.pdl)
        from nanovllm.kernels.gemv_rows import gemv_rows_silu_linear
        return gemv_rows_silu_linear(x, weight, pdl=self.pdl)


def skinny_linear_or_none(max_tokens: int | None = None) -> SkinnyKernels | None:
    """The few-token kernels when this engine's layers use them (for up to max_tokens tokens, default
    SKINNY_MAX_TOKENS), else None."""
    options = kernel_options()
    if not options.skinny_gemm:
        return None
    return SkinnyKernels(options.pdl, SKINNY_MAX_TOKENS if max_tokens is None else max_tokens)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           skinny: SkinnyKernels | None = None) -> torch.Tensor:
    if skinny is not None and skinny.takes(x):
        return skinny.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.skinny = skinny_linear_or_none()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
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
        return self.local_matmul(x)

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's matmul alone, without communication (what the GEMM warm-up runs)."""
        return linear(x, self.weight, self.bias, self.skinny)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (e.g. an MoE router, whose logits every rank needs)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, _divide(output_size, get_tp_size(), "output size"), bias, tp_dim=0)

    def normed(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), or without a residual (self(norm(x)), x): the
        decoder's RMSNorm (layers/layernorm.py) and the projection after it, one kernel for a few rows."""
        fused = self.skinny is not None and self.skinny.fuses(x)
        if fused and (residual is None or residual.is_contiguous()):
            return self.skinny.norm_linear(x, norm.weight, norm.eps, self.weight, self.bias, residual)
        if residual is None:
            return self(norm(x)), x
        normed, residual = norm(x, residual)
        return self(normed), residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        for size in output_sizes:  # each part is split on its own, not just their sum
            _divide(size, get_tp_size(), "output size")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        self._check_shape(param, loaded, shard_id)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[int | str | None, tuple[int, ...]]:
        return {i: (size, *param.shape[1:]) for i, size in enumerate(self.output_sizes)}


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads are split across ranks; K/V heads too, or replicated when
    there are fewer K/V heads than ranks (each rank then keeps the one its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
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
        LinearBase.__init__(self, hidden_size, output_size, bias, tp_dim=0)

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
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(_divide(input_size, get_tp_size(), "input size"), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.local_matmul(x))
        return y if self.bias is None else y + self.bias

    def local_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the partial sums are reduced.
        return linear(x, self.weight, skinny=self.skinny)

    def silu_mul_forward(self, gate_up: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        """self(act_fn(gate_up)) for the SiLU-gated MLP's [gate | up]: one kernel for up to GEMV_MAX_ROWS."""
        if self.skinny is None or not self.skinny.folds_silu(gate_up):
            return self(act_fn(gate_up))
        y = all_reduce(self.skinny.silu_linear(gate_up, self.weight))
        return y if self.bias is None else y + self.bias
