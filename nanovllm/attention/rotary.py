"""Rotary position embedding (neox style: rotate halves): the cos/sin tables, one per model and shared
by its layers, with the inverse frequencies from the model config (transformers' scaled RoPE types
included), and `apply_rotary`, the plain PyTorch rotation the reference backend uses (the GPU
backends rotate inside nanovllm.kernels.rope_store)."""

import torch
from torch import nn
from transformers import PretrainedConfig


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2], attention scaling) as transformers computes them."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        # [max_position, head_dim] each; float32 so that lower-precision runs round only once.
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D] -> both rotated to their positions."""
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
