"""Which modules a quantized checkpoint's exclusion list (compressed-tensors' `ignore`, ModelOpt's
`exclude_modules`) must leave out, and which it must not: nanovllm runs every decoder projection, dense
or expert, in the checkpoint's fp8, and keeps the LM head (unless tied to the embedding) and each sparse
layer's router in the model dtype. A list that disagrees would have weights loaded as what they are not,
so it is refused; each format says how its entries match a module's name."""

from collections.abc import Callable

from transformers import PretrainedConfig

from nanovllm.utils.moe_layout import is_sparse_layer


def quantized_modules(hf_config: PretrainedConfig) -> list[str]:
    """The checkpoint names of the modules nanovllm runs in fp8: every decoder projection, dense or
    expert (for an MoE model, both forms in every layer: a superset, as exclusion patterns are checked
    against it)."""
    experts = getattr(hf_config, "num_experts", 0) or 0
    names, mlp = [], ("gate", "up", "down")
    for layer in range(hf_config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        names += [f"{prefix}.self_attn.{p}_proj" for p in "qkvo"]
        names += [f"{prefix}.mlp.{p}_proj" for p in mlp]
        names += [f"{prefix}.mlp.experts.{e}.{p}_proj" for e in range(experts) for p in mlp]
    return names


def kept_modules(hf_config: PretrainedConfig) -> list[str]:
    """The checkpoint names of the modules nanovllm keeps in the model dtype that a quantizer would
    otherwise take: the LM head (a tied one is the embedding) and each sparse layer's router."""
    kept = [] if getattr(hf_config, "tie_word_embeddings", False) else ["lm_head"]
    return kept + [f"model.layers.{i}.mlp.gate" for i in range(hf_config.num_hidden_layers)
                   if is_sparse_layer(hf_config, i)]


def check_excluded(hf_config: PretrainedConfig, excluded: Callable[[str], bool], listing: str,
                   refuse: Callable[[str], ValueError]) -> None:
    """Raise refuse(...) unless `excluded` (whether the list leaves a module unquantized) leaves out
    exactly what nanovllm keeps in the model dtype; `listing` names the list in the message."""
    for name in quantized_modules(hf_config):
        if excluded(name):
            raise refuse(f"leaves {name!r} unquantized ({listing}), which nanovllm does not implement")
    for name in kept_modules(hf_config):
        if not excluded(name):
            raise refuse(f"quantizes {name!r} (not in {listing}), which nanovllm keeps in the model dtype")
