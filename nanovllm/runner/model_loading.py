"""One rank's model, built on its device in the model dtype with the kernel plan's layer methods, and its
weights: random ones for load_format "dummy", else a GGUF file's or a safetensors checkpoint's, brought
to the kernels' layouts (process_weights_after_loading); a checkpoint's calibrated KV-cache scales then
go to the attention layers for an fp8 cache (runner/kv_cache.py)."""

import logging

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.kernel_plan import KernelPlan, process_weights_after_loading
from nanovllm.models import get_model_class
from nanovllm.runner import kv_cache
from nanovllm.utils.loader import init_dummy_weights, load_model, load_weights

logger = logging.getLogger("nanovllm")


def build_model(config: Config, plan: KernelPlan, device: torch.device, dtype: torch.dtype,
                kv_dtype: torch.dtype) -> nn.Module:
    """The loaded model in eval mode; kv_dtype: the KV cache's element type."""
    hf = config.hf_config
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: nn.Module = get_model_class(hf)(hf, plan)
    finally:
        torch.set_default_dtype(default_dtype)
    kv_scales = None
    if config.load_format == "dummy":
        init_dummy_weights(model, std=getattr(hf, "initializer_range", 0.02), seed=config.seed)
    elif config.load_format == "gguf":
        kv_scales = load_weights(model, config.gguf.weights(dtype), config.gguf_path)
    else:
        kv_scales = load_model(model, config.model)
    process_weights_after_loading(model)
    kv_cache.use_checkpoint_scales(model, kv_scales, kv_dtype)
    logger.debug("weights loaded (%s, %s on %s)", config.load_format, dtype, device)
    return model.eval()
