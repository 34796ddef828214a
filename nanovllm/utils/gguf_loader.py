"""A GGUF model, parsed once per LLM: `GGUFCheckpoint(path)` reads the file's header
(utils/gguf_reader.py) and derives from it the Hugging Face config, the tokenizer and the weights,
dequantized to the run dtype and named as in a Hugging Face checkpoint (llama.cpp's permuted Q/K
rows put back), so they load through the same path as safetensors.

The config and tokenizer come out as transformers builds them from the same file (its GGUF key
table and tokenizer converter; tests/models/test_smollm2_gguf.py compares both); the weights are
dequantized by utils/gguf_dequant.py. Model families: those nanovllm runs (llama, qwen2, qwen3)."""

import importlib.util
import re
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from nanovllm.utils.gguf_reader import GGUFFile, TensorInfo

if TYPE_CHECKING:  # torch is imported by whatever calls weights(): the config side needs none
    import torch

GGUF_SUFFIX = ".gguf"
INSTALL_HINT = "pip install 'nanovllm[gguf]' (or: pip install gguf)"
# llama.cpp tensor names -> Hugging Face names, for the Llama-like decoders nanovllm runs.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Mixture of experts (qwen3moe): the router, and every expert's weights stacked in one tensor.
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
}
# llama.cpp's architecture names that transformers spells differently.
TRANSFORMERS_ARCHITECTURE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's converter interleaves the rotary halves of Q/K rows for this architecture only.
PERMUTED_QK_ARCHITECTURES = ("llama",)


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading .gguf files needs the gguf package; {INSTALL_HINT}")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor, or None for one no model here uses (rope_freqs)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match and match[2] in LAYER_NAMES:
        return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"
    return None


def unpermute_qk(weight: "torch.Tensor", num_heads: int) -> "torch.Tensor":
    """Undo llama.cpp's Q/K row order: per head, it interleaves the two rotary halves
    ([h, 2, d/2] -> [h, d/2, 2]); put the halves back one after the other."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


class GGUFCheckpoint:
    """One .gguf file: `hf_config`, `tokenizer()` and `weights(dtype)` from a single parse."""

    def __init__(self, path: str) -> None:
        require_gguf()
        try:
            self.file = GGUFFile(path)
        except (ValueError, OSError, UnicodeDecodeError, struct.error) as e:  # struct: a truncated file
            raise ValueError(f"cannot read {path!r} as a GGUF model: {e}") from e
        self.path = path
        if "general.architecture" not in self.file.metadata:
            raise ValueError(f"{path!r} names no model architecture (general.architecture); is it a model?")
        self.architecture: str = self.file.metadata["general.architecture"]
        self.hf_config = self._config()

    def _grouped(self, group: str) -> dict:
        """transformers' renames of the file's metadata for one group (config, tokenizer, ...)."""
        from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

        renames = GGUF_TO_TRANSFORMERS_MAPPING[group]
        out = {}
        for key, value in self.file.metadata.items():
            prefix, _, rest = key.partition(".")
            name = renames.get(TRANSFORMERS_ARCHITECTURE.get(prefix, prefix), {}).get(rest)
            if name not in (None, -1):
                out[name] = value
        return out

    def _config(self) -> PretrainedConfig:
        from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

        if TRANSFORMERS_ARCHITECTURE.get(self.architecture, self.architecture) not in \
                GGUF_TO_TRANSFORMERS_MAPPING["config"]:
            raise ValueError(f"{self.path!r} holds a {self.architecture!r} model, which transformers' GGUF "
                             "support (and so nanovllm) cannot read")
        values = self._grouped("config")
        # As transformers: tied embeddings when there is no separate output matrix; the vocabulary
        # size from the token list when the file does not state it.
        values["tie_word_embeddings"] = "output.weight" not in self.file.tensors
        if "vocab_size" not in values and "tokenizer.ggml.tokens" in self.file.metadata:
            values["vocab_size"] = len(self.file.metadata["tokenizer.ggml.tokens"])
        # transformers reads no head size for Qwen2/Qwen3 files and falls back to the config class's
        # default (128, right for every released Qwen3); the file states it, so take it from there.
        key_length = self.file.metadata.get(f"{self.architecture}.attention.key_length")
        if "head_dim" not in values and key_length is not None:
            values["head_dim"] = key_length
        # Nor does it read the experts' width, leaving the config class's default (right for
        # Qwen3-30B-A3B only).
        expert_width = self.file.metadata.get(f"{self.architecture}.expert_feed_forward_length")
        if expert_width is not None:
            values["moe_intermediate_size"] = expert_width
        model_type = TRANSFORMERS_ARCHITECTURE.get(values.get("model_type"), values.pop("model_type"))
        # Defaults llama.cpp's graphs assume but the file does not state (Qwen3-MoE: normalised top-k).
        try:
            from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING
        except ImportError:  # older transformers
            GGUF_CONFIG_DEFAULTS_MAPPING = {}
        for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}).items():
            values.setdefault(key, value)
        try:
            hf_config = AutoConfig.for_model(model_type, **values)
        except (ValueError, KeyError) as e:
            raise ValueError(f"cannot build a config for {self.path!r}: {e}") from e
        # A GGUF names its model type ("llama"), not the class; take the class transformers would
        # build for it, so the model registry can pick the family.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
        hf_config.architectures = [arch] if arch else [f"{hf_config.model_type} (GGUF)"]
        return hf_config

    def tokenizer(self) -> PreTrainedTokenizerBase:
        try:
            from transformers.integrations.gguf import convert_gguf_tokenizer
        except ImportError:  # transformers < 5
            from transformers.integrations.ggml import convert_gguf_tokenizer
        tokenizer_dict = self._grouped("tokenizer")
        options = self._grouped("tokenizer_config")
        backend, extra = convert_gguf_tokenizer(self.architecture, tokenizer_dict)
        tokens = tokenizer_dict.get("tokens", [])
        for role in ("bos", "eos", "unk", "pad"):
            token_id = tokenizer_dict.get(f"{role}_token_id")
            if token_id is not None and 0 <= token_id < len(tokens):
                options[f"{role}_token"] = tokens[token_id]
        return PreTrainedTokenizerFast(tokenizer_object=backend, **options, **extra)

    def weights(self, dtype: "torch.dtype") -> Iterator[tuple[str, "torch.Tensor"]]:
        """(Hugging Face name, dequantized tensor in `dtype`) for every tensor a model here uses."""
        from gguf import GGML_QUANT_SIZES

        from nanovllm.utils.gguf_dequant import dequantize  # torch: only where weights are loaded

        hf = self.hf_config
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        permuted = self.architecture in PERMUTED_QK_ARCHITECTURES
        for info in self.file.tensors.values():
            name = hf_tensor_name(info.name)
            if name is None:
                continue
            tensor = dequantize(self._raw(info, GGML_QUANT_SIZES), info.ggml_type, info.shape)
            if permuted and ".attn_q." in info.name:
                tensor = unpermute_qk(tensor, hf.num_attention_heads)
            elif permuted and ".attn_k." in info.name:
                tensor = unpermute_qk(tensor, num_kv_heads)
            yield name, tensor.to(dtype)

    def _raw(self, info: TensorInfo, quant_sizes: dict) -> np.ndarray:
        """The stored bytes as gguf's dequantize wants them: [..., bytes per row] uint8."""
        block_elements, block_bytes = quant_sizes[info.ggml_type]
        row_bytes = info.shape[-1] // block_elements * block_bytes
        num_rows = 1
        for dim in info.shape[:-1]:
            num_rows *= dim
        return self.file.bytes_of(info, num_rows * row_bytes).reshape(num_rows, row_bytes)
