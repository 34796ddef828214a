"""The attention layer of one decoder layer: its slice of the paged KV cache (set by the model runner),
the model's rotary tables (one RotaryEmbedding shared by its layers), the optional q/k norm, and the
engine's backend, which does the work. Also the plain PyTorch forms of the norm and the rotation:
`rms_norm`, which the reference backend's q/k norm and the model's RMSNorm layers (layers/norm_act.py)
share, and `apply_rotary` (the GPU backends norm and rotate inside their kernels); and `cache_scales`, an
int8 cache's per-token scales as the backends pass them.

Rotary position embedding is neox style (rotate halves), with the inverse frequencies from the model
config (transformers' scaled RoPE types included)."""

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.attention.backend import AttentionBackend, PagedLayer, QKNorm
from nanovllm.attention.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and rounded once, as transformers does, so float32 outputs match it
    exactly."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


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


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 qk_norm: QKNorm | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.rotary = rotary  # one module shared by every layer of the model
        self.qk_norm = qk_norm
        # Set by the model runner when it allocates the cache (the GPU warm-up uses a temporary one).
        self.k_cache = self.v_cache = torch.empty(0)
        # Per-layer scales of an fp8 KV cache (kv_cache_dtype="fp8"): the cache holds k / k_scale and
        # v / v_scale. 1.0 suits models whose keys and values stay well inside e4m3's range (448).
        self.k_scale = self.v_scale = 1.0
        # An int8 KV cache's scales (kv_cache_dtype="int8"), set with the cache: a float32 per cached token
        # and KV head, [num_blocks, block_size, num_kv_heads]; the cache holds round(k / scale). Else empty.
        self.k_cache_scales = self.v_cache_scales = torch.empty(0)
        self.backend: AttentionBackend | None = None

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The q/k/v projection's output [T, (H + 2 Hkv) D], before norm and rotary -> attention output
        [T, H D]."""
        assert self.backend is not None, "attention backend not set; the model runner sets it"
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(self, q, k, v, positions, meta)
        num_real = meta.cu_seqlens_q_host[-1] if meta.is_prefill and meta.cu_seqlens_q_host else out.shape[0]
        if num_real < out.shape[0]:
            # Padding rows (runner/inputs.py) attend to nothing, so no backend writes their output:
            # zeros, not whatever the allocation held, go on through the layer (an MoE router).
            out[num_real:].zero_()
        return out.flatten(1, -1)


def cache_scales(layer: PagedLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The layer's (k_cache_scales, v_cache_scales) with an int8 cache, else (None, None) (and a layer
    without them, as the tests' stand-ins, is read the same)."""
    if layer.k_cache.dtype != torch.int8:
        return None, None
    return layer.k_cache_scales, layer.v_cache_scales
