"""Qwen3 family (dense): the shared decoder with per-head q/k RMSNorm before RoPE; `attention_bias`
switches the bias of all four attention projections."""

from transformers import PretrainedConfig

from nanovllm.models.decoder import AttentionOptions, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qk_norm=True, qkv_bias=bias, o_bias=bias)
