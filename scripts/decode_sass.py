"""Offline sm_90 build report of the split-KV decode kernel: registers, shared memory, programs per SM
and the tile loop's instruction counts from the SASS, without a GPU.

The build must be the one the GPU runs, so run this under the device's Triton version (an H200 host
had Triton 3.6: a 3.9 build of the same kernel differs by 30 registers), e.g. in a virtual environment
(here .venv-t36) holding triton==3.6.0 and a CPU build of torch:

    PYTHONPATH=. .venv-t36/bin/python scripts/decode_sass.py      # the builds of DEFAULT_BUILDS
    PYTHONPATH=. .venv-t36/bin/python scripts/decode_sass.py "n64 TILES=words BLOCK_N=64 num_warps=8"

Like the runtime launcher, it tells the compiler that every pointer and every stride argument that is
specialized (not in do_not_specialize) is 16-byte divisible: without that hint the loads are not
vectorized and the build is not the one that runs. --dump DIR keeps each build's SASS, PTX and TTGIR.
For every other kernel, one case of tests/kernels/sm90_cases.py at a time: tests/kernels/sm90_build.py.
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

# It compiles for sm_90 offline and never runs a kernel: under TRITON_INTERPRET=1 (as the tests set it)
# @triton.jit would hand back interpreted functions, which do not compile.
os.environ["TRITON_INTERPRET"] = "0"
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanovllm.kernels import decode_attention  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
# An H100/H200 SM: 64K registers, 228 KB of shared memory (1 KB of it reserved per program),
# registers allocated per warp in units of 256 (so per thread in units of 8).
SM_REGISTERS = 65536
SM_SHARED_MEMORY = 233472
SHARED_MEMORY_RESERVED_PER_PROGRAM = 1024
MAX_PROGRAMS_PER_SM = 32
# Qwen3-0.6B's decode: 16 query heads over 8 KV heads, head_dim 128, 256-token blocks; the large-batch
# launch (decode_launch.WIDE).
PRODUCTION = dict(NUM_HEADS_PER_KV=2, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_G=16, BLOCK_N=128,
                  COMBINE_HEADS=2, COMBINE_ROWS=16, DOT_PRECISION="tf32", TILES="cast", ORDERED=True,
                  KV_PER_PROG=1)
CACHE_TYPES = {"fp8": "*fp8e4nv", "int8": "*i8", "bf16": "*bf16"}
POINTER_TYPES = {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "counters_ptr": "*i32",
                 "k_scales_ptr": "*fp32", "v_scales_ptr": "*fp32",
                 "seqlens_k_ptr": "*i32", "block_tables_ptr": "*i32", "seq_order_ptr": "*i32"}
FLOAT_SCALARS = {"scale_log2", "v_scale"}
# Instruction classes counted in the tile loop (the opcode before the first '.').
COUNTED = ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "HMMA", "HGMMA", "F2FP", "PRMT", "I2F", "F2F", "HADD2",
           "HMUL2", "HFMA2", "LOP3", "SHF", "IMAD", "IADD3", "FMUL", "FADD", "FFMA", "FMNMX", "MUFU", "SHFL",
           "BAR", "MOV", "FSEL", "FSETP", "ISETP", "SEL", "LEA", "DEPBAR")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def build(kernel, constexprs: dict, cache_type: str, q_type: str, num_warps: int, num_stages: int,
          maxnreg: int | None = None):
    names = kernel.arg_names
    skip = set(kernel.do_not_specialize) | {names[i] for i in kernel.do_not_specialize if isinstance(i, int)}
    signature, attrs = {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params, strict=True)):
        if name in constexprs or param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = cache_type if "cache" in name else POINTER_TYPES.get(name, q_type)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in skip:  # production strides are multiples of 16 elements
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=H200, options=options)


def sass_of(cubin: bytes) -> tuple[str, int]:
    """(SASS text, registers per thread) from cuobjdump."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = knobs.nvidia.cuobjdump.path
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", res).group(1))


def hot_loop(sass: str) -> list[str]:
    """The instructions of the loop whose body holds the tensor-core ops (HMMA/HGMMA), found as the
    span of a backward branch."""
    instrs = [(int(a, 16), text.strip()) for a, text in SASS_LINE.findall(sass)]
    best = []
    for addr, text in instrs:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in instrs if int(m.group(1), 16) <= a <= addr]
            if any("MMA" in t for t in body) and len(body) > len(best):
                best = body
    return best


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text)  # the predicate guard
    return text.split()[0].split(".")[0]


def programs_per_sm(regs: int, shared: int, num_warps: int) -> tuple[int, int, int]:
    per_warp = ((regs * 32 + 255) // 256) * 256
    by_regs = SM_REGISTERS // (per_warp * num_warps)
    by_shared = SM_SHARED_MEMORY // (shared + SHARED_MEMORY_RESERVED_PER_PROGRAM)
    return min(by_regs, by_shared, MAX_PROGRAMS_PER_SM), by_regs, by_shared


def report(name: str, kernel, constexprs: dict, cache_type: str, q_type: str, num_warps: int,
           num_stages: int, dump: str | None, maxnreg: int | None = None) -> dict:
    compiled = build(kernel, constexprs, cache_type, q_type, num_warps, num_stages, maxnreg)
    sass, regs = sass_of(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    loop = hot_loop(sass)
    counts = collections.Counter(opcode(t) for t in loop)
    programs, by_regs, by_shared = programs_per_sm(regs, shared, num_warps)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("sass", sass), ("ptx", compiled.asm["ptx"]), ("ttgir", compiled.asm["ttgir"])):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(text)
        with open(os.path.join(dump, f"{name}.loop.sass"), "w") as f:
            f.write("\n".join(loop) + "\n")
    spills = sum(1 for _, text in SASS_LINE.findall(sass) if opcode(text) in ("STL", "LDL"))
    return dict(name=name, regs=regs, spills=spills, shared=shared, programs=programs,
                by_regs=by_regs, by_shared=by_shared, loop=len(loop), counts=counts)


def print_table(rows: list[dict]) -> None:
    present = [c for c in COUNTED if any(r["counts"].get(c) for r in rows)]
    print(f"{'build':16} {'regs':>4} {'spill':>5} {'smem':>6} {'prog/SM':>9} {'loop':>5} "
          + " ".join(f"{c:>6}" for c in present))
    for r in rows:
        occ = f"{r['programs']}({r['by_regs']}r,{r['by_shared']}s)"
        print(f"{r['name']:16} {r['regs']:>4} {r['spills']:>5} {r['shared']:>6} {occ:>9} {r['loop']:>5} "
              + " ".join(f"{r['counts'].get(c, 0):>6}" for c in present))


# "name key=value ...": the cache dtype, launch options (num_warps, num_stages, maxnreg) and constexprs
# over PRODUCTION's, 4 warps and 2 stages.
DEFAULT_BUILDS = (
    "bf16 cache=bf16",
    "cast cache=fp8",
    "words cache=fp8 TILES=words",
    "words-n64 cache=fp8 TILES=words BLOCK_N=64",
    "words-n64-r96 cache=fp8 TILES=words BLOCK_N=64 maxnreg=96",
    "words-r128 cache=fp8 TILES=words maxnreg=128",
    "cast-s3 cache=fp8 num_stages=3 ORDERED=False",  # decode_launch.SMALL_BATCH
    "words-s3 cache=fp8 TILES=words num_stages=3 ORDERED=False",
    "int8-cast-n64 cache=int8 BLOCK_N=64 num_stages=5",  # decode_launch.FP8_LARGE_BATCH, an int8 cache
    "int8-words-n64 cache=int8 TILES=words BLOCK_N=64 num_stages=5",
)
OPTIONS = ("cache", "num_warps", "num_stages", "maxnreg")


def parse_build(spec: str) -> tuple[str, dict, dict]:
    name, *items = spec.split()
    values = dict(item.split("=", 1) for item in items)
    options = dict(cache="fp8", num_warps=4, num_stages=2, maxnreg=None)
    options.update({k: v for k, v in values.items() if k in OPTIONS})
    constexprs = dict(PRODUCTION)
    literals = {"True": True, "False": False}
    for key, value in values.items():
        if key not in OPTIONS:
            constexprs[key] = literals.get(value, int(value) if value.isdigit() else value)
    return name, constexprs, options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="*", default=DEFAULT_BUILDS,
                        help='"name key=value ...", e.g. "words-n64 TILES=words BLOCK_N=64 maxnreg=96"')
    parser.add_argument("--dump", default=None, help="a folder for each build's SASS, PTX and TTGIR")
    args = parser.parse_args()
    kernel = decode_attention._decode_split_kernel
    rows = []
    for spec in args.builds:
        name, constexprs, options = parse_build(spec)
        # Constexprs this checkout's kernel does not have (an older branch's) are dropped.
        constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
        if options["cache"] not in CACHE_TYPES:
            parser.error(f"cache={options['cache']}: one of {', '.join(CACHE_TYPES)}")
        cache_type = CACHE_TYPES[options["cache"]]
        maxnreg = int(options["maxnreg"]) if options["maxnreg"] else None
        rows.append(report(name, kernel, constexprs, cache_type, "*bf16", int(options["num_warps"]),
                           int(options["num_stages"]), args.dump, maxnreg))
    print(f"triton {triton.__version__}, sm_90, bf16 queries; loop = instructions per tile and warp")
    print_table(rows)


if __name__ == "__main__":
    main()
