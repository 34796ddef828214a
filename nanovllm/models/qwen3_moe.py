"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder whose feed-forward block is a
sparse mixture of experts (layers/fused_moe.py) in every `decoder_sparse_step`-th layer, except the
layers listed in `mlp_only_layers`, which keep a dense MLP of `intermediate_size` (utils/moe_layout.py).
Checkpoints name one tensor per expert; `expert_params_mapping` stacks them at load."""

from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.fused_moe import DOWN, GATE, GATE_UP, UP, SparseMoeBlock
from nanovllm.layers.kernel_plan import KernelPlan
from nanovllm.models.decoder import DecoderMLP
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.moe_layout import is_sparse_layer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # checkpoint projection of an expert -> (stacked parameter of MoEExperts, part)
    expert_params_mapping = {
        "gate_proj": ("w13_weight", GATE),
        "up_proj": ("w13_weight", UP),
        "down_proj": ("w2_weight", DOWN),
        "gate_up_proj": ("w13_weight", GATE_UP),  # every expert's gate and up rows at once (GGUF)
    }

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_idx: int, plan: KernelPlan) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return DecoderMLP(config, plan)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", False)),
                              config.hidden_act, plan.router, plan.quantization)
