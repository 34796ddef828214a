"""GGUF files through transformers' GGUF support: the config, the tokenizer and the weights of one
`.gguf` file, the weights dequantized to the run dtype and named as in a Hugging Face checkpoint
(llama.cpp's permuted Q/K rows put back), so they load through the same path as safetensors.
Only what transformers can read is accepted; anything else raises ValueError saying so."""

import importlib.util
import inspect
import os
from collections.abc import Iterator

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from nanovllm.utils.hf_options import HF_LOCAL_ONLY

GGUF_SUFFIX = ".gguf"
INSTALL_HINT = "pip install 'nanovllm[gguf]' (or: pip install gguf)"


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading .gguf files needs the gguf package; {INSTALL_HINT}")


def _split(path: str) -> tuple[str, str]:
    """transformers takes a GGUF as (folder, gguf_file=name)."""
    folder, name = os.path.split(os.path.abspath(path))
    return folder, name


def load_gguf_config(path: str) -> PretrainedConfig:
    require_gguf()
    folder, name = _split(path)
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, **HF_LOCAL_ONLY)
    except Exception as e:  # a truncated or corrupt file fails deep in gguf's reader, with any error type
        raise ValueError(f"cannot read {path!r} as a GGUF model that transformers supports: {e}") from e
    if not getattr(hf_config, "architectures", None):
        # A GGUF names its model type ("llama"), not the class; take the class transformers would
        # build for it, so the model registry can pick the family.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
        hf_config.architectures = [arch] if arch else [f"{hf_config.model_type} (GGUF)"]
    if hasattr(hf_config, "moe_intermediate_size"):
        # transformers does not read the experts' width (llama.cpp's expert_feed_forward_length) and
        # leaves the config class's default, right for Qwen3-30B-A3B only: take it from the file.
        from gguf import GGUFReader
        reader = GGUFReader(path)
        arch_field = reader.fields.get("general.architecture")
        arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
        width = reader.fields.get(f"{arch_name}.expert_feed_forward_length")
        if width is not None:
            hf_config.moe_intermediate_size = int(width.parts[width.data[0]][0])
    return hf_config


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    folder, name = _split(path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, **HF_LOCAL_ONLY)


class _TopLevelNames:
    """The slice of a transformers model that `get_gguf_hf_weights_map` reads: config, parameter
    names, children. transformers walks every submodule and rebuilds gguf's tensor-name table for
    each (~400 tables for SmolLM2-135M, ~9 s on 2 CPU cores); a decoder-only checkpoint maps fully
    from the top-level names (the walk is for models converted from a submodule, like Bloom), so it
    gets no children. A tensor this failed to name would surface as a missing weight when loading."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.config = hf_model.config
        self._names = dict.fromkeys(hf_model.state_dict())

    def state_dict(self) -> dict[str, None]:
        return self._names

    def named_children(self) -> list:
        return []


def gguf_weights(path: str, hf_config: PretrainedConfig,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, dequantized tensor in `dtype`) for every tensor of the file."""
    require_gguf()
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only the parameter names are needed: allocate nothing
        hf_model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
    options = {}
    # transformers >= 5 casts each tensor right after dequantizing it, so a bfloat16 run never holds
    # the whole model in float32; with older versions the copy into the model casts.
    if "torch_dtype" in inspect.signature(load_gguf_checkpoint).parameters:
        options["torch_dtype"] = dtype
    try:
        parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=_TopLevelNames(hf_model),
                                      **options)
    except Exception as e:  # as in load_gguf_config: name the file whatever the reader raised
        raise ValueError(f"cannot read the weights of GGUF file {path!r} (truncated or corrupt?): {e}") from e
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    while tensors:  # pop as we go, so each tensor is freed once the model holds its copy
        name, tensor = tensors.popitem()
        yield name, tensor
