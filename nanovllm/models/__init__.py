"""Model families, picked by the `architectures` entry of a checkpoint's config.json (for a GGUF
file, Config fills that entry in from the file's model type)."""

from torch import nn
from transformers import PretrainedConfig


def model_registry() -> dict[str, type[nn.Module]]:
    """Architecture name -> model class. Imported lazily so `import nanovllm` stays light."""
    from nanovllm.models.llama import LlamaForCausalLM
    from nanovllm.models.qwen2 import Qwen2ForCausalLM
    from nanovllm.models.qwen3 import Qwen3ForCausalLM
    from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM
    return {
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "LlamaForCausalLM": LlamaForCausalLM,
        # Mistral's layers and checkpoint names are Llama's; its sliding window, when the config
        # turns one on, is rejected by the model class.
        "MistralForCausalLM": LlamaForCausalLM,
    }


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    registry = model_registry()
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in registry:
            return registry[arch]
    raise ValueError(f"model architecture {archs or 'unknown'} is not supported; "
                     f"supported architectures: {sorted(registry)}")
