"""The "nanovllm" logger, and the one line each LLM logs at INFO once it is built: which model file
and family, dtype and device, attention backend, KV-cache capacity in tokens, tensor-parallel size
(and CPU threads). The line shows by default; `logging.getLogger("nanovllm").setLevel(
logging.WARNING)` silences it, and any logging configuration of the program's own takes over."""

import logging
import os

LOGGER_NAME = "nanovllm"
logger = logging.getLogger(LOGGER_NAME)
DEFAULT_FORMAT = "nanovllm: %(message)s"


def ensure_default_handler() -> None:
    """Where the program configured no logging at all (no handler on this logger or the root one),
    print nanovllm's INFO lines on stderr, as vLLM does; a level set on the logger is kept."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(DEFAULT_FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def startup_line(config, info) -> str:
    """The line for an engine built from `config` (a nanovllm.config.Config) whose executor reports
    `info` (a nanovllm.engine.executor.ExecutorInfo; this module sits below both and only reads them).
    E.g. "SmolLM2-135M-Instruct.Q4_1.gguf (llama, gguf), float32 on cpu, attention torch, KV cache
    87,040 tokens, TP 1, CPU threads auto (1 now)"."""
    model = os.path.basename((config.gguf_path or config.model).rstrip(os.sep)) or config.model
    num_kv_tokens = info.num_kvcache_blocks * config.kvcache_block_size
    cpu_threads = info.cpu_threads
    parts = [f"{model} ({config.hf_config.model_type}, {config.load_format})",
             f"{info.dtype} on {info.device}", f"attention {info.attention_backend}",
             f"KV cache {num_kv_tokens:,} tokens" + _quantized_cache(config.kv_cache_dtype),
             f"TP {config.tensor_parallel_size}"]
    if cpu_threads is not None:
        parts.append(f"CPU threads {config.cpu_threads} ({cpu_threads} now)")
    return ", ".join(parts)


def _quantized_cache(kv_cache_dtype: str) -> str:
    """What follows the KV cache's size: ' (fp8)' or ' (int8)' for a quantized cache, else nothing."""
    return "" if kv_cache_dtype == "auto" else f" ({kv_cache_dtype.removesuffix('_e4m3')})"
