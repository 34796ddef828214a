"""Qwen2 family (Qwen2, Qwen2.5): the Qwen3 decoder without the q/k norms, with a bias on the q/k/v
projections and none on the output projection, as its checkpoints always have."""

from transformers import PretrainedConfig

from nanovllm.models.qwen3 import AttentionOptions, Qwen3ForCausalLM


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qk_norm=False, qkv_bias=True, o_bias=False)
