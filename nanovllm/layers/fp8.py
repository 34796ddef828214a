"""fp8 (e4m3) weights: `Fp8LinearMethod` for the linear layers, and the scales of MoE experts
(layers/fused_moe.py), for the three ways an fp8 model arrives (utils/config_checks.Fp8Scheme):

- a block-wise checkpoint (Qwen's and DeepSeek's FP8 layout): `weight_scale_inv` [ceil(N/128), ceil(K/128)],
  one scale per 128x128 weight block; activations scaled per token and group of 128 inputs;
- a per-tensor or per-channel checkpoint (vLLM's "fp8" without weight_block_size): `weight_scale` [] or [N];
  activations scaled per token;
- either in compressed-tensors' layout (utils/compressed_tensors.py): `weight_scale` [1], [N, 1]
  or, per block, [ceil(N/rows), ceil(K/columns)]; or in ModelOpt's (utils/modelopt.py): [] or [N];
- `quantization="fp8"` on a bf16/fp32 checkpoint: weights quantized at load, per output channel.

Checkpoints with calibrated (static) activation scales take layers/fp8_static.py's methods, built on these.

After loading every layer holds one layout:

    weight        float8_e4m3fn [N, K]
    weight_scale  float32 [N, ceil(K / group)]    weight[n, k] is weight[n, k] * weight_scale[n, k // group]

group: the block's columns, or K (one scale per output channel). A block scale is kept with its row
repeated for each output row of its block (3% of the weight's bytes at 128x128): every tensor-parallel layer
then shards and fuses it exactly as it does the weight's rows, at any offset of q/k/v or gate/up;
`block_scales` recovers the compact [N / rows, K / columns] blocks from it where a GEMM wants those.

`Fp8LinearMethod` is the dequantizing reference (the CPU's, and older GPUs'): the activations quantized to
e4m3 per token (group) and back, the weight dequantized exactly, both multiplied in the model's dtype.
GPUs with fp8 tensor cores run kernels instead (layers/fp8_methods.py)."""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear_methods import Bucket, LinearMethod, add_split_counters
from nanovllm.utils.config_checks import Fp8Scheme

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest amax a scale is taken from: an all-zero group gets a tiny scale, not a division by zero
# (vLLM's per-token-group quantization uses the same floor).
MIN_AMAX = 1e-10


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], float32 scales [..., ceil(K / group)]): each group of `group` values
    along the last dim scaled so that its largest magnitude becomes FP8_MAX."""
    k = x.shape[-1]
    num_groups = math.ceil(k / group)
    xf = F.pad(x.float(), (0, num_groups * group - k)).unflatten(-1, (num_groups, group))
    scale = xf.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2)[..., :k], scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scales [ceil(N / rows), ceil(K / columns)]) for block = (rows,
    columns): a block-scaled checkpoint's weight and weight_scale_inv, each block's largest magnitude
    scaled to FP8_MAX. For writing checkpoints (benchmarks, tests); the engine reads them."""
    (n, k), (rows, columns) = w.shape, block
    nb, kb = math.ceil(n / rows), math.ceil(k / columns)
    tiles = F.pad(w.float(), (0, kb * columns - k, 0, nb * rows - n)).view(nb, rows, kb, columns)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * rows, kb * columns)[:n, :k].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The exact float32 values of e4m3 q [..., K] with scales [..., ceil(K / group)]."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., : q.shape[-1]]


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through e4m3 and back, per token and group of `group` inputs, in x's dtype: the rounding of a
    W8A8 kernel's dynamic activation quantization."""
    return dequantize(*quantize_groups(x, group), group).to(x.dtype)


def fp8_dequant_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                       bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ dequantize(weight [N, K], weight_scale [N, ceil(K / group)])^T (+ bias), the
    activations quantized per token and group first; in x's dtype."""
    w = dequantize(weight, weight_scale, group).to(x.dtype)
    return F.linear(quantize_activations(x, group), w, bias)


def fp8_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                           bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ dequantize(weight, weight_scale)^T (+ bias) in float32, x unrounded (W8A16), in x's
    dtype: what kernels/fp8_gemv.py computes."""
    return F.linear(x.float(), dequantize(weight, weight_scale, group),
                    None if bias is None else bias.float()).to(x.dtype)


def check_block_split(what: str, size: int, block: int, tp_size: int, axis: str) -> None:
    if tp_size > 1 and size % block:
        raise ValueError(f"tensor_parallel_size={tp_size} splits the fp8 checkpoint's weight-scale blocks: "
                         f"{what} holds {size} {axis} per rank, not a multiple of the block's {block}; use "
                         "a tensor_parallel_size that keeps every block on one rank")


def _column_shards(layer: nn.Module, output_size: int) -> list[int]:
    """The output rows each checkpoint tensor of a column-parallel layer puts on one rank."""
    if hasattr(layer, "output_sizes"):  # MergedColumnParallelLinear
        return [size // layer.tp_size for size in layer.output_sizes]
    if hasattr(layer, "num_kv_heads"):  # QKVParallelLinear
        return [layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim]
    return [output_size]


def block_rows_view(rows_of: Callable[[object], int], block_rows: int) -> Callable[..., torch.Tensor]:
    """A block scale's checkpoint_view (utils/weight_tracker.py): [..., ceil(rows/block), C] ->
    [..., rows, C], each block's row repeated for its output rows; rows_of(shard_id) -> rows."""

    def view(loaded: torch.Tensor, shard_id: object = None) -> torch.Tensor:
        rows = rows_of(shard_id)
        num_blocks = math.ceil(rows / block_rows)
        if loaded.dim() < 2 or loaded.shape[-2] != num_blocks:
            raise ValueError(f"fp8 block scale of shape {tuple(loaded.shape)} does not fit a weight of "
                             f"{rows} rows in blocks of {block_rows} ({num_blocks} block rows)")
        return loaded.float().repeat_interleave(block_rows, dim=-2)[..., :rows, :]

    return view


def channel_view(rows_of: Callable[[object], int], stacked: Callable[[object], bool] = lambda _: False,
                 keep_dim: bool = False) -> Callable[..., torch.Tensor]:
    """A per-tensor or per-channel scale's checkpoint_view: [] / [1] / [rows] / [rows, 1] (with a
    leading experts dim when stacked(shard_id)) -> [rows] ([rows, 1] with keep_dim)."""

    def view(loaded: torch.Tensor, shard_id: object = None) -> torch.Tensor:
        rows = rows_of(shard_id)
        lead = tuple(loaded.shape[:1]) if stacked(shard_id) else ()
        flat = loaded.float().reshape(*lead, -1)
        if flat.shape[-1] == 1:
            flat = flat.expand(*lead, rows)
        elif flat.shape[-1] != rows:
            raise ValueError(f"fp8 weight_scale of shape {tuple(loaded.shape)} is neither per tensor nor per "
                             f"channel of a weight of {rows} rows")
        return (flat.unsqueeze(-1) if keep_dim else flat).contiguous()

    return view


class Fp8LinearMethod(LinearMethod):
    """fp8 weights and float32 scales (the module docstring's layout); every call through the
    dequantizing reference (the CPU's method, and GPUs' without fp8 tensor cores). Its decode calls round
    the activations too, unlike the GPU's W8A16 GEMV: without that rounding (fp8_weight_only_linear up to
    16 rows) the tiny model's greedy tokens left W8A8 transformers' at the fourth token
    (tests/models/test_fp8_checkpoints.py), so the CPU keeps the one rounding those tests compare with."""

    BUCKETS = (Bucket(None, fp8_dequant_linear),)

    def __init__(self, scheme: Fp8Scheme, pdl: bool = False) -> None:
        super().__init__(pdl)
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       weight_loader: Callable[..., None]) -> None:
        block, tp_size = self.scheme.block, layer.tp_size
        dtype = FP8 if self.scheme.serialized else None  # None: the model's, quantized after loading
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = weight_loader
        if not self.scheme.serialized:
            return

        def rows_of(shard_id: object) -> int:
            return layer.checkpoint_shapes(scale)[shard_id][0]

        if block is None:
            scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32), requires_grad=False)
            scale.checkpoint_view = channel_view(rows_of)
            layer.weight_scale = scale
        else:
            name = type(layer).__name__
            if layer.tp_dim == 0:
                for size in _column_shards(layer, output_size):
                    check_block_split(name, size, block[0], tp_size, "output rows")
            elif layer.tp_dim == 1:
                check_block_split(name, input_size, block[1], tp_size, "input columns")
            scale = nn.Parameter(torch.empty(output_size, math.ceil(input_size / block[1]),
                                             dtype=torch.float32), requires_grad=False)
            scale.checkpoint_view = block_rows_view(rows_of, block[0])
            setattr(layer, self.scheme.block_scale_name, scale)
        scale.weight_loader = weight_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.scheme.serialized:
            weight, scale = quantize_groups(layer.weight.data, layer.weight.shape[1])
            layer.weight = nn.Parameter(weight, requires_grad=False)
        elif self.scheme.block is None:
            scale = layer.weight_scale.data.unsqueeze(1)
        else:
            scale = getattr(layer, self.scheme.block_scale_name).data
            delattr(layer, self.scheme.block_scale_name)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        add_split_counters(layer)

    def group(self, layer: nn.Module) -> int:
        return self.scheme.block[1] if self.scheme.block is not None else layer.weight.shape[1]

    def weights(self, layer: nn.Module) -> tuple:
        return layer.weight, layer.weight_scale, self.group(layer)


def block_scales(weight_scale: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]
                 ) -> torch.Tensor | None:
    """The compact [N / rows, K / columns] scales of a block-scaled weight [N, K] from the layout's
    per-row copy ([N, K / columns], each block's row repeated), in the padded layout torch's block-scaled
    GEMM takes (kernels/fp8_scaled_mm.padded_block_scales); None where the weight is not whole blocks, or a
    block's rows differ (a merged layer whose parts do not start on a block)."""
    (n, k), (rows, columns) = weight.shape, block
    if n % rows or k % columns or weight_scale.shape != (n, k // columns):
        return None
    per_block = weight_scale.view(n // rows, rows, k // columns)
    if not torch.equal(per_block, per_block[:, :1].expand_as(per_block)):
        return None
    from nanovllm.kernels.fp8_scaled_mm import padded_block_scales
    return padded_block_scales(per_block[:, 0])
