"""The decoder the Llama-like families share (Llama, Qwen2, Qwen3): GQA attention with RoPE (and, for
Qwen3, per-head q/k RMSNorm), SiLU-gated MLP, tied or untied LM head, built from tensor-parallel layers.
Checkpoint names map onto the fused layers through `packed_modules_mapping`. A family is this decoder
with its own `AttentionOptions` (models/llama.py, qwen2.py, qwen3.py).

Every family attends to the whole context: a config with an active sliding window is rejected here
rather than run with the wrong attention. The step's attention metadata is an argument of forward. The
kernels the layers take are the KernelPlan's the model is built with (layers/kernel_plan.py)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.attention.backend import QKNorm
from nanovllm.attention.layer import Attention, RotaryEmbedding
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.kernel_plan import KernelPlan
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.norm_act import RMSNorm, SiluAndMul


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
    """The attention block's modules (checkpoint names self_attn.*); DecoderLayer calls them in turn."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, rotary: RotaryEmbedding,
                 plan: KernelPlan) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, options.qkv_bias, plan.linear)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        options.o_bias, plan.linear)
        qk_norm = None
        if options.qk_norm:  # checkpoint names: self_attn.q_norm.weight, self_attn.k_norm.weight
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, rotary, qk_norm)


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, plan: KernelPlan) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias, plan.linear)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, plan.linear)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """down(act(gate_up(x))); given the RMSNorm before the block, (self(norm(x + residual)),
        x + residual), or without a residual (self(norm(x)), x). Each projection folds in the norm or the
        activation before it where its linear method can; or the activation folds into gate_up's kernel
        after it (its epilogue) where that projection's method can, and down runs plain."""
        gated = self.gate_up_proj.gated(x, norm, residual)
        if gated is not None:
            activated, residual = gated
            down = self.down_proj(activated)
        elif norm is None:
            down = self.down_proj(self.gate_up_proj(x), act=self.act_fn)
        else:
            gate_up, residual = self.gate_up_proj(x, norm=norm, residual=residual)
            down = self.down_proj(gate_up, act=self.act_fn)
        return down if norm is None else (down, residual)


class DecoderLayer(nn.Module):
    """x = x + attn(norm(x)); x = x + mlp(norm(x)). Each RMSNorm is handed to the projection after it,
    which folds it in where its linear method can; the residual stream runs alongside."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, rotary: RotaryEmbedding,
                 mlp: nn.Module, plan: KernelPlan) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, options, rotary, plan)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.attention_input(hidden_states, residual)
        return self.attention_output(self.self_attn.attn(qkv, positions, meta), residual)

    # The layer either side of its attention, the one part that reads the step's metadata: these two
    # depend on the token count alone, so runner/piecewise.py captures them in CUDA graphs and runs the
    # attention between them.
    def attention_input(self, hidden_states: torch.Tensor, residual: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_layernorm, then the q/k/v projection: (qkv [T, (H + 2 Hkv) D], residual stream)."""
        return self.self_attn.qkv_proj(hidden_states, norm=self.input_layernorm, residual=residual)

    def attention_output(self, attn_out: torch.Tensor, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection of the attention's [T, H D], then post_attention_layernorm and the MLP:
        (this layer's output, residual stream)."""
        hidden_states = self.self_attn.o_proj(attn_out)
        return self.mlp(hidden_states, norm=self.post_attention_layernorm, residual=residual)


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions,
                 build_mlp: Callable[[PretrainedConfig, int, KernelPlan], nn.Module], plan: KernelPlan
                 ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(config, options, rotary, build_mlp(config, i, plan), plan)
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
    def build_mlp(cls, config: PretrainedConfig, layer_idx: int, plan: KernelPlan) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (families with MoE layers override this): called
        as DecoderMLP is, with or without the norm before it."""
        return DecoderMLP(config, plan)

    def __init__(self, config: PretrainedConfig, plan: KernelPlan | None = None) -> None:
        """plan: the kernels the layers take (the model runner's, for its device and dtype); None: torch
        everywhere."""
        super().__init__()
        plan = plan if plan is not None else KernelPlan.torch_only()
        window = sliding_window_in_use(config)
        if window is not None:
            raise ValueError(f"this {type(self).__name__} config uses sliding-window attention "
                             f"(sliding_window={window}), which nanovllm does not implement; use a "
                             "checkpoint whose config.json has \"sliding_window\": null")
        self.model = DecoderModel(config, self.attention_options(config), self.build_mlp, plan)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, plan.lm_head)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden_states)
