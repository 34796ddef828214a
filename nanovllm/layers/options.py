"""Kernel choices a layer makes once, when it is built: whether few-token matmuls use the skinny GEMM
kernel, and whether those launch as programmatic dependents. The model runner makes its engine's options
current while it builds the model (a ContextVar: per engine and per thread); layers read them in __init__
and never again."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KernelOptions:
    skinny_gemm: bool = False  # 1-16 token matmuls through kernels.skinny_gemm / skinny_rows (CUDA only)
    pdl: bool = False  # ...launched as programmatic dependents (kernels.common.supports_pdl: sm_90+)


# KernelOptions is frozen: the shared default cannot be mutated.
_current: ContextVar[KernelOptions] = ContextVar("nanovllm_kernel_options", default=KernelOptions())  # noqa: B039


@contextmanager
def use_kernel_options(options: KernelOptions) -> Iterator[KernelOptions]:
    token = _current.set(options)
    try:
        yield options
    finally:
        _current.reset(token)


def kernel_options() -> KernelOptions:
    return _current.get()
