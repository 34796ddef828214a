"""`GPUCompiled(fn)`: fn, callable eagerly or through torch.compile, as its caller chose (the sampler:
Config.torch_compile); the compiled twin only ever sees CUDA tensors.

Sampling costs several kernels eagerly (scaling, masking, two argmaxes); torch.compile fuses them into
a couple. On CPU the eager code is kept: it matches transformers bit for bit, and compiling would only
slow the tests down."""

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
