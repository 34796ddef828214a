"""Llama family (Llama 2/3, SmolLM, Mistral-style configs without a sliding window): the shared
decoder without the q/k norms; `attention_bias` switches the bias of all four projections."""

from transformers import PretrainedConfig

from nanovllm.models.decoder import AttentionOptions, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qk_norm=False, qkv_bias=bias, o_bias=bias)
