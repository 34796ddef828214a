"""Which decoder layers of a Qwen3-MoE config hold the sparse mixture of experts (as transformers decides
it): every `decoder_sparse_step`-th layer but those in `mlp_only_layers`, which keep a dense MLP. The
model builds its layers by it, and the checkpoint checks ask it which layers have a router."""

from transformers import PretrainedConfig


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and (getattr(config, "num_experts", 0) or 0) > 0 and (layer_idx + 1) % step == 0)
