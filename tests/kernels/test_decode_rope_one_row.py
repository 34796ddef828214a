"""The one-row CUDA decode kernel (kernels/cuda_decode_rope.py, decode_rope_one_row.cu).

On the CPU: the launcher's parameter list against the kernel's signature, which calls it takes, an
NVRTC build for sm_90 of every variant the engine launches (128 registers, no spills), as
test_sm90_compile does for the Triton kernels, and what a launch hands the driver (a stand-in libcuda):
every argument, the grid, the PDL attribute. On a GPU (CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0):
against the Triton kernel it stands in for, the same cache stores and outputs within bf16 rounding of
the summation order, the chunk counters left zeroed."""

import ctypes
import functools
import math
import os
import re
import types

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.kernels import cuda_decode_rope, nvrtc  # noqa: E402
from nanovllm.kernels.cuda_decode_rope import PARAMETERS, supports, variant_defines  # noqa: E402

ON_GPU = os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
C_KINDS = {"i64": "i64", "int": "i32", "float": "f32"}


def kernel_parameters() -> list[tuple[str, str]]:
    """(name, kind) of the .cu kernel's parameters, pointers as "ptr"."""
    with open(cuda_decode_rope.SOURCE_PATH) as f:
        source = f.read()
    signature = re.search(r"decode_rope_cuda\((.*?)\)\s*\{", source, re.S).group(1)
    params = []
    for declaration in signature.split(","):
        words = declaration.replace("__restrict__", "").split()
        name, kind = words[-1].lstrip("*"), "ptr" if "*" in declaration else C_KINDS[words[-2]]
        params.append((name, kind))
    return params


def test_launcher_passes_the_kernels_parameters_in_order():
    assert list(PARAMETERS) == kernel_parameters()


def _tensors(rows=1, heads=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16, cache_dtype=None,
             block_size=256):
    qkv = torch.zeros(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    cache = torch.zeros(4, block_size, kv_heads, head_dim, dtype=cache_dtype or dtype)
    return q, k, v, cache


def test_supports_only_what_was_measured():
    assert supports(*_tensors())  # Qwen3-0.6B at one row
    assert supports(*_tensors(dtype=torch.float16))
    assert not supports(*_tensors(rows=2))
    assert not supports(*_tensors(heads=32))  # groups of 4
    assert not supports(*_tensors(heads=8))  # no GQA
    assert not supports(*_tensors(head_dim=64))
    assert not supports(*_tensors(dtype=torch.float32))
    assert not supports(*_tensors(cache_dtype=torch.float8_e4m3fn))
    assert not supports(*_tensors(cache_dtype=torch.int8))  # its scales are the Triton kernel's to read
    assert not supports(*_tensors(block_size=32))


def _nvrtc_or_skip():
    try:
        nvrtc.nvrtc_library()
    except OSError as e:
        pytest.skip(f"no NVRTC: {e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("int64_indices", [False, True])  # graphs' static buffers hold int32, eager int64
def test_builds_for_sm90_at_128_registers_without_spills(dtype, int64_indices):
    _nvrtc_or_skip()
    with open(cuda_decode_rope.SOURCE_PATH) as f:
        source = f.read()
    defines = variant_defines(2, 8, dtype, int64_indices, int64_indices, pdl=True)
    cubin, log = nvrtc.compile_cubin(source, defines, "sm_90", ptxas_verbose=True)
    registers = re.search(r"Used (\d+) registers", log)
    assert cubin and registers and int(registers.group(1)) <= 128, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log


def test_a_rejected_source_raises_compile_error():
    _nvrtc_or_skip()
    with pytest.raises(nvrtc.CompileError, match="sm_90"):
        nvrtc.compile_cubin("this is not CUDA", {}, "sm_90")


def _gpu_case(rows, ctxs, dtype, width, int64_indices, pad_slot, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, kv_heads, group, head_dim, block_size = "cuda", 8, 2, 128, 256
    heads = kv_heads * group
    num_blocks = rows * width + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=dev, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=dev, generator=gen)
    tables = torch.randperm(num_blocks - 4, device=dev, generator=gen)[: rows * width].view(rows, width)
    tables = tables.to(torch.int32)
    seqlens = torch.tensor(ctxs, dtype=torch.int32, device=dev)
    positions = (seqlens.long() - 1).clamp(min=0)
    slots = torch.tensor([int(tables[r, (c - 1) // block_size]) * block_size + (c - 1) % block_size
                          if c else -1 for r, c in enumerate(ctxs)], dtype=torch.int64, device=dev)
    if pad_slot:
        slots[0] = -1  # a row whose new key is not stored: the kernel reads the cache there
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=dev, generator=gen) * 2
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    angles = torch.outer(torch.arange(8192, device=dev).float(), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    norms = [(torch.rand(head_dim, device=dev, dtype=dtype, generator=gen) + 0.5, 1e-6) for _ in range(2)]
    if not int64_indices:
        positions, slots = positions.int(), slots.int()
    return (q, k, v, positions, cos, sin, k_cache, v_cache, slots, seqlens, tables, head_dim ** -0.5), norms


# (rows, contexts): tile edges, one chunk to the whole 4,096-key table, a padding row (context 0), and
# 80 rows at a one-block table (one chunk a context: the output stored without a combine).
GPU_CASES = [(1, [1]), (1, [63]), (1, [64]), (1, [65]), (1, [640]), (1, [1024]), (1, [1100]), (1, [1536]),
             (1, [3000]), (1, [4096]), (2, [700, 1]), (3, [0, 129, 2000]),
             (80, [37 * i % 250 + 1 for i in range(80)])]


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0)")
@pytest.mark.parametrize("rows,ctxs", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("int64_indices", [False, True])
def test_matches_the_triton_kernel_on_gpu(rows, ctxs, dtype, int64_indices):
    from nanovllm.kernels.decode_rope import paged_decode_rope_attention

    args, (q_norm, k_norm) = _gpu_case(rows, ctxs, dtype, 1 if rows == 80 else 16, int64_indices, rows == 2)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots, seqlens, tables, scale = args
    cuda_args = list(args)
    cuda_args[6], cuda_args[7] = k_cache.clone(), v_cache.clone()
    counters = [torch.zeros(rows * 8, dtype=torch.int32, device="cuda") for _ in range(2)]
    ref = paged_decode_rope_attention(*args, q_norm=q_norm, k_norm=k_norm, counters=counters[0])
    kernel = cuda_decode_rope.OneRowDecodeRope(q.device).prepared(q, k, positions, slots, pdl=False)
    for _ in range(2):  # twice: the second call finds the counters zeroed
        out = kernel(*cuda_args, q_norm=q_norm, k_norm=k_norm, counters=counters[1])
    torch.cuda.synchronize()
    # New keys within one bf16 step of the Triton kernel's (rsqrt and FMA contraction may differ)
    assert (cuda_args[6].float() - k_cache.float()).abs().max() <= 2 ** -7 * k_cache.float().abs().max()
    assert torch.equal(cuda_args[7].view(torch.int16), v_cache.view(torch.int16))
    assert int(counters[1].abs().sum()) == 0
    assert (out.float() - ref.float()).abs().max() < 2e-2


class FakeDriver:
    """Stands in for libcuda: records what cuLaunchKernelEx was given (the probe once lost its PDL
    attribute to a ctypes copy: docs/performance-notes.md, "Decode attention at one row")."""

    def __init__(self):
        self.launches = []

    def cuModuleLoadData(self, module, cubin):
        return 0

    def cuModuleGetFunction(self, function, module, name):
        return 0

    def cuFuncGetAttribute(self, value, attribute, function):
        return 0

    def cuLaunchKernelEx(self, config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(nvrtc._LaunchConfig)).contents
        value_at = nvrtc._LaunchAttribute.value.offset  # the raw bytes: .value stops at a zero byte
        attrs = [config.attrs[i] for i in range(config.num_attrs)]
        attrs = [(a.id, ctypes.c_int.from_address(ctypes.addressof(a) + value_at).value) for a in attrs]
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        values = []
        for i, (_, kind) in enumerate(PARAMETERS):
            ctype = {"ptr": ctypes.c_void_p, "i64": ctypes.c_longlong, "i32": ctypes.c_int,
                     "f32": ctypes.c_float}[kind]
            values.append(ctypes.cast(pointers[i], ctypes.POINTER(ctype)).contents.value)
        self.launches.append(dict(grid=(config.grid_x, config.grid_y, config.grid_z), block=config.block_x,
                                  attrs=attrs, values=values))
        return 0


@pytest.mark.parametrize("pdl", [False, True])
def test_the_launch_passes_each_argument_and_the_pdl_attribute(monkeypatch, pdl):
    driver = FakeDriver()
    monkeypatch.setattr(nvrtc, "_driver", lambda: driver)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0))
    q, k, v, cache = _tensors()
    v_cache = cache.clone()
    positions, slots = torch.tensor([5]), torch.tensor([5])
    seqlens, tables = torch.tensor([6], dtype=torch.int32), torch.zeros(1, 16, dtype=torch.int32)
    cos, sin = torch.zeros(8, 128), torch.zeros(8, 128)
    norms = (torch.ones(128), 1e-6), (torch.ones(128), 2e-6)
    counters = torch.zeros(8, dtype=torch.int32)
    launch = functools.partial(cuda_decode_rope._launch, nvrtc.CudaFunction(b"", "decode_rope_cuda"))
    out = launch(q, k, v, positions, cos, sin, cache, v_cache, slots, seqlens, tables, 0.5, q_norm=norms[0],
                 k_norm=norms[1], counters=counters, pdl=pdl)
    (call,) = driver.launches
    assert call["grid"] == (8, 1, 64) and call["block"] == cuda_decode_rope.THREADS  # 4,096 keys: 64 chunks
    assert call["attrs"] == ([(nvrtc._PROGRAMMATIC_STREAM_SERIALIZATION, 1)] if pdl else [])
    got = dict(zip([name for name, _ in PARAMETERS], call["values"], strict=True))
    for name, tensor in (("q", q), ("k", k), ("v", v), ("k_cache", cache), ("v_cache", v_cache), ("out", out),
                         ("counters", counters), ("seqlens", seqlens), ("block_tables", tables),
                         ("positions", positions), ("slots", slots), ("cos_t", cos), ("sin_t", sin),
                         ("q_w", norms[0][0]), ("k_w", norms[1][0])):
        assert got[name] == tensor.data_ptr(), name
    assert (got["q_sb"], got["q_sh"], got["k_sh"], got["o_sh"]) == (q.stride(0), 128, 128, 128)
    assert [got[n] for n in ("bt_stride", "nsplit", "nkv_arg", "bs", "has_norm")] == [16, 64, 8, 256, 1]
    assert got["q_eps"] == pytest.approx(1e-6) and got["k_eps"] == pytest.approx(2e-6)
    assert got["scale_log2"] == pytest.approx(0.5 * math.log2(math.e))
