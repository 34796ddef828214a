"""`GPUCompiled(fn)`: fn, callable eagerly or through torch.compile, as its caller chose when it was
built (nanovllm.layers.options); the compiled twin only ever sees CUDA tensors.

Decode at small batch sizes is bound by kernel launches, not bandwidth: eager RMSNorm, SiLU-mul and
sampling cost several kernels each. torch.compile fuses each into one. On CPU the eager code is kept:
it matches transformers bit for bit, and compiling would only slow the tests down."""

import functools
from collections.abc import Callable

import torch


class GPUCompiled:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: Callable | None = None  # a cache, built on first use
        functools.update_wrapper(self, fn)

    def __call__(self, compiled: bool, x: torch.Tensor, *args):
        if not (compiled and x.is_cuda):
            return self.fn(x, *args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True)
        return self._compiled(x, *args)
