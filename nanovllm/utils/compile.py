"""`gpu_compiled(fn)`: run fn through torch.compile when its inputs live on a GPU, eagerly otherwise.

Decode at small batch sizes is bound by kernel launches, not bandwidth: eager RMSNorm, rotary and
SiLU-mul cost several kernels each per layer. torch.compile fuses each into one. On CPU the eager
code is kept: it matches transformers bit for bit, and compiling would only slow the tests down."""

import functools
import os
from collections.abc import Callable

import torch

# Set to 0 to run the GPU path eagerly too (debugging, or to measure what compilation buys).
COMPILE_ENV_VAR = "NANOVLLM_COMPILE"


def gpu_compiled(fn: Callable) -> Callable:
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        nonlocal compiled
        if not x.is_cuda or os.environ.get(COMPILE_ENV_VAR, "1") == "0":
            return fn(x, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args, **kwargs)

    return wrapper
