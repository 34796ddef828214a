"""The decoder the Llama-like families share (Llama, Qwen2, Qwen3): GQA attention with RoPE (and, for
Qwen3, per-head q/k RMSNorm), SiLU-gated MLP, tied or untied LM head, built from tensor-parallel layers.
Checkpoint names map onto the fused layers through `packed_modules_mapping`. A family is this decoder
with its own `AttentionOptions` (models/llama.py, qwen2.py, qwen3.py).

Every family attends to the whole context: a config with an active sliding window is rejected here
rather than run with the wrong attention. The step's attention metadata is an argument of forward."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.attention.backend import QKNorm
from nanovllm.attention.layer import Attention
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.rotary import RotaryEmbedding
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """Where the attention blocks of the families built on this decoder differ."""

    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    qkv_bias: bool
    o_bias: bool


def sliding_window_in_use(config: PretrainedConfig) -> int | None:
    """The window size if any layer of this config attends through a sliding window, else None."""
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2/Qwen3 keep a size but switch it off
        return None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, rotary: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=options.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=options.o_bias)
        qk_norm = None
        if options.qk_norm:  # checkpoint names: self_attn.q_norm.weight, self_attn.k_norm.weight
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, rotary, qk_norm)

    # No forward: the decoder layer calls qkv_proj, attend and o_proj apart, each half of the layer with
    # its norm folded into the projection where it can (DecoderLayer.before_attention, after_attention).
    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention between the projections: [T, (H + 2 Hkv) D] -> [T, H D]."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.attn(q, k, v, positions, meta).flatten(1, -1)


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.silu_mul_forward(self.gate_up_proj(x), self.act_fn)

    def normed(self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), the norm folded into the first projection."""
        gate_up, residual = self.gate_up_proj.normed(x, norm, residual)
        return self.down_proj.silu_mul_forward(gate_up, self.act_fn), residual


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, rotary: RotaryEmbedding,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, options, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.before_attention(hidden_states, residual)
        return self.after_attention(self.self_attn.attend(qkv, positions, meta), residual)

    # The layer in two halves around its attention, which needs the step's metadata: what comes before
    # and after it depends on the token count alone (runner/piecewise.py captures it in CUDA graphs).
    def before_attention(self, hidden_states: torch.Tensor, residual: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv projection [T, (H + 2 Hkv) D], residual stream)."""
        return self.self_attn.qkv_proj.normed(hidden_states, self.input_layernorm, residual)

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, residual stream) from the attention's output [T, H D]."""
        hidden_states = self.self_attn.o_proj(attn_out)
        if isinstance(self.mlp, DecoderMLP):  # folds the norm into its first projection where it can
            return self.mlp.normed(hidden_states, self.post_attention_layernorm, residual)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions,
                 build_mlp: Callable[[PretrainedConfig, int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(config, options, rotary, build_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        raise NotImplementedError("each family says how its attention differs")

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (families with MoE layers override this)."""
        return DecoderMLP(config)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        window = sliding_window_in_use(config)
        if window is not None:
            raise ValueError(f"this {type(self).__name__} config uses sliding-window attention "
                             f"(sliding_window={window}), which nanovllm does not implement; use a "
                             "checkpoint whose config.json has \"sliding_window\": null")
        self.model = DecoderModel(config, self.attention_options(config), self.build_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden_states)
