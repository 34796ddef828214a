"""Qwen2 family (Qwen2, Qwen2.5): the shared decoder without the q/k norms, with a bias on the q/k/v
projections and none on the output projection, as its checkpoints always have."""

from transformers import PretrainedConfig

from nanovllm.models.decoder import AttentionOptions, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qk_norm=False, qkv_bias=True, o_bias=False)
