"""fp8 MoE experts (layers/fused_moe.py): their stacked e4m3 weights and float32 scales, registered for
loading and brought to layers/fp8.py's layout after it (one scale row per weight row, groups along K),
for the three ways an fp8 model arrives (block-wise and per-channel checkpoints, quantization="fp8");
with static activation scales (layers/fp8_static.py) also `w13_input_scale` and `w2_input_scale` [E], one
scale an expert (its gate's and up's larger)."""

import math
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.layers.fp8 import FP8, block_rows_view, channel_view, check_block_split, quantize_groups
from nanovllm.utils.config_checks import Fp8Scheme

# Expert weights (layers/fused_moe.py's MoEExperts): w13 [E, 2I, H] and w2 [E, H, I], scales as in fp8.py.


def create_expert_weights(experts: nn.Module, scheme: Fp8Scheme) -> None:
    """Register the stacked expert weights (fp8 when the checkpoint's are) and their scales, loaded through
    experts.weight_loader; `expert_proj` tells the loader which projection a parameter belongs to."""
    e, h, i, tp_size = experts.num_experts, experts.hidden_size, experts.intermediate_size, experts.tp_size
    dtype = FP8 if scheme.serialized else None
    shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i)}
    for proj, shape in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader, param.expert_proj = experts.weight_loader, proj
        setattr(experts, f"{proj}_weight", param)
    if not scheme.serialized:
        return

    def rows_of(shard_id: object) -> int:
        return experts.checkpoint_rows(shard_id[1])

    def stacked(shard_id: object) -> bool:
        return shard_id[0] is None

    for proj, (_, rows, cols) in shapes.items():
        if scheme.block is None:
            scale = nn.Parameter(torch.empty(e, rows, 1, dtype=torch.float32), requires_grad=False)
            scale.checkpoint_view, scale.sharded_cols = channel_view(rows_of, stacked, keep_dim=True), False
            name = f"{proj}_weight_scale"
        else:
            bn, bk = scheme.block
            check_block_split("each expert", i, bn if proj == "w13" else bk, tp_size,
                               "intermediate rows" if proj == "w13" else "intermediate columns")
            scale = nn.Parameter(torch.empty(e, rows, math.ceil(cols / bk), dtype=torch.float32),
                                 requires_grad=False)
            scale.checkpoint_view = block_rows_view(rows_of, bn)
            name = f"{proj}_{scheme.block_scale_name}"
        scale.weight_loader, scale.expert_proj = experts.weight_loader, proj
        setattr(experts, name, scale)
        if scheme.static_input:  # one input_scale an expert and projection, a copy a row as loaded
            inputs = nn.Parameter(torch.empty(e, rows, 1, dtype=torch.float32), requires_grad=False)
            inputs.checkpoint_view, inputs.sharded_cols = expert_scalar_view(rows_of, stacked), False
            inputs.weight_loader, inputs.expert_proj = experts.weight_loader, proj
            setattr(experts, f"{proj}_input_scale", inputs)


def expert_scalar_view(rows_of: Callable[[object], int], stacked: Callable[[object], bool]
                       ) -> Callable[..., torch.Tensor]:
    """An expert's input_scale's checkpoint_view: [] or [1] (with a leading experts dim when stacked) ->
    [rows, 1], the scale copied to each row its projection part fills (so that the experts' loader
    places it as it places a weight's rows)."""

    def view(loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        lead = tuple(loaded.shape[:1]) if stacked(shard_id) else ()
        flat = loaded.float().reshape(*lead, -1)
        if flat.shape[-1] != 1:
            raise ValueError(f"fp8 input_scale of shape {tuple(loaded.shape)} is not one scale an expert")
        return flat.expand(*lead, rows_of(shard_id)).unsqueeze(-1).contiguous()

    return view


def process_expert_weights(experts: nn.Module, scheme: Fp8Scheme) -> None:
    """The loaded experts in the module docstring's layout: w13_weight, w2_weight fp8 and w13_weight_scale,
    w2_weight_scale float32."""
    for proj in ("w13", "w2"):
        if scheme.static_input:  # an expert's gate and up see the same input: the larger scale (as dense)
            per_expert = getattr(experts, f"{proj}_input_scale").data.amax(dim=(1, 2))
            setattr(experts, f"{proj}_input_scale", nn.Parameter(per_expert, requires_grad=False))
        weight = getattr(experts, f"{proj}_weight")
        if not scheme.serialized:
            q, scale = quantize_groups(weight.data, weight.shape[2])
            setattr(experts, f"{proj}_weight", nn.Parameter(q, requires_grad=False))
        elif scheme.block is not None:
            scale = getattr(experts, f"{proj}_{scheme.block_scale_name}").data
            delattr(experts, f"{proj}_{scheme.block_scale_name}")
        else:
            continue
        setattr(experts, f"{proj}_weight_scale", nn.Parameter(scale, requires_grad=False))


def expert_groups(experts: nn.Module, scheme: Fp8Scheme) -> tuple[int, int]:
    """The scale groups of w13 and w2 along their inputs."""
    if scheme.block is not None:
        return scheme.block[1], scheme.block[1]
    return experts.w13_weight.shape[2], experts.w2_weight.shape[2]
