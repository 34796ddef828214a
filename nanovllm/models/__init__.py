"""Model families, picked by the `architectures` entry of a checkpoint's config.json."""

from transformers import PretrainedConfig


def get_model_class(hf_config: PretrainedConfig):
    from nanovllm.models.qwen3 import Qwen3ForCausalLM
    registry = {"Qwen3ForCausalLM": Qwen3ForCausalLM}
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in registry:
            return registry[arch]
    raise ValueError(f"model architecture {archs or 'unknown'} is not supported; "
                     f"supported architectures: {sorted(registry)}")
