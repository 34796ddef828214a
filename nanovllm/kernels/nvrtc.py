"""CUDA C++ kernels compiled at run time: NVRTC (the runtime compiler that ships with torch's CUDA build,
or the `nvidia-cuda-nvrtc-cu12` wheel) turns source into a cubin, and the CUDA driver API loads it and
launches it, through ctypes. No nvcc, no build step, no new dependency: the path for the few kernels
whose control over registers and synchronization Triton does not give (kernels/cuda_decode_rope.py).

`launch` can start a kernel as a programmatic dependent of the one before it (PDL, sm_90+), as Triton's
`launch_pdl=True` does, and is CUDA-graph capturable (cuLaunchKernelEx on the current stream)."""

import ctypes
import functools
import glob
import os

import torch

# cuLaunchKernelEx's launch attribute that lets the kernel overlap the one before it (cuda.h's
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION), and cuFuncGetAttribute's register count.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_NUM_REGS = 4


class CompileError(RuntimeError):
    """NVRTC rejected the source (the message holds its log)."""


@functools.cache
def nvrtc_library() -> ctypes.CDLL:
    """libnvrtc: torch's (CUDA builds), else the nvidia-cuda-nvrtc wheel's, else the system's."""
    try:
        from torch.cuda._utils import _get_gpu_rtc_library
        return _get_gpu_rtc_library()
    except Exception:  # a CPU build of torch, or a torch without the helper
        pass
    candidates = []
    try:
        import nvidia.cuda_nvrtc as wheel  # the pip wheel: nvidia/cuda_nvrtc/lib/libnvrtc.so.12
        candidates += sorted(glob.glob(os.path.join(list(wheel.__path__)[0], "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    candidates += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    errors = []
    for name in candidates:
        if "builtins" in name or ".alt." in name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise OSError(f"no NVRTC library found (tried {candidates}): install torch with CUDA, or "
                  f"nvidia-cuda-nvrtc-cu12; {errors[-1] if errors else ''}")


def compile_cubin(source: str, defines: dict[str, int], arch: str, ptxas_verbose: bool = False
                  ) -> tuple[bytes, str]:
    """(cubin, NVRTC's log) of `source` for `arch` (e.g. "sm_90"), with each define prepended as a
    macro. ptxas_verbose puts ptxas' register and spill report in the log."""
    nv = nvrtc_library()
    program = ctypes.c_void_p()
    text = "".join(f"#define {name} {int(value)}\n" for name, value in defines.items()) + source
    _check_nvrtc(nv, nv.nvrtcCreateProgram(ctypes.byref(program), text.encode(), b"kernel.cu", 0, None, None))
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"]
        if ptxas_verbose:
            options.append(b"--ptxas-options=-v")
        result = nv.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(program, log)
        if result != 0:
            raise CompileError(f"NVRTC could not compile for {arch} with {defines}:\n{log.value.decode()}")
        _check_nvrtc(nv, nv.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(nv, nv.nvrtcGetCUBIN(program, cubin))
        return cubin.raw, log.value.decode()
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(program))


def _check_nvrtc(nv, result: int) -> None:
    if result != 0:
        nv.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CompileError(f"NVRTC error {result}: {nv.nvrtcGetErrorString(result).decode()}")


class _LaunchAttribute(ctypes.Structure):  # cuda.h's CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # cuda.h's CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    return lib


def _check_driver(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"CUDA driver error {result} in {what}")


class CudaFunction:
    """A kernel loaded from a cubin into the current device's context (torch's primary context). Its
    module stays loaded for the process (tens of KB of device memory): CUDA graphs captured with its
    launches may outlive any one owner, and a graph must not meet an unloaded function."""

    def __init__(self, cubin: bytes, name: str) -> None:
        lib = _driver()
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        _check_driver(lib.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        _check_driver(lib.cuModuleGetFunction(ctypes.byref(self.function), self.module, name.encode()),
                      "cuModuleGetFunction")
        regs = ctypes.c_int()
        _check_driver(lib.cuFuncGetAttribute(ctypes.byref(regs), _FUNC_NUM_REGS, self.function),
                      "cuFuncGetAttribute")
        self.num_registers = regs.value

    def launch(self, grid: tuple[int, int, int], block: int, args: list, pdl: bool = False) -> None:
        """Launch on torch's current stream. `args`: ctypes values (c_void_p for pointers) in the order
        of the kernel's parameters."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        config = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, 0, stream)
        attribute = _LaunchAttribute()
        if pdl:
            attribute.id = _PROGRAMMATIC_STREAM_SERIALIZATION
            # value.programmaticStreamSerializationAllowed = 1 (written in place: reading the c_char
            # array field gives a copy)
            ctypes.memmove(ctypes.addressof(attribute) + _LaunchAttribute.value.offset,
                           ctypes.byref(ctypes.c_int(1)), ctypes.sizeof(ctypes.c_int))
            config.attrs, config.num_attrs = ctypes.pointer(attribute), 1
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                                   for a in args))
        _check_driver(_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, pointers, None),
                      "cuLaunchKernelEx")
