"""Building sm_90 cubins of the Triton kernels' cases (sm90_cases.py) without a GPU, and reading them.

Triton's NVIDIA backend ships ptxas, cuobjdump and nvdisasm in its wheel, so a case compiles ahead of time
for a named target, and its cubin tells what only a GPU would otherwise show: registers, spills, and the
instructions of each loop. test_sm90_compile.py builds every case; run this file to read one build:

    TRITON_INTERPRET=0 python tests/kernels/sm90_build.py skinny-gemm-fp8-add-rms-norm-pdl BLOCK_K=512

prints its registers, stack (spilled) bytes and shared memory, its instruction mix, and each loop's
instructions by kind (a loop's count over the weight bytes it moves a warp says how close to issue-bound a
streaming kernel is). KEY=VALUE overrides a constexpr, or num_warps / num_stages."""

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from sm90_cases import FLOAT_SCALARS, POINTER_TYPES, cases
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)
# Integer arguments that hold a model's dimensions or a tensor's strides: multiples of 16 for every model
# the engine runs, so the runtime's build of a launch has them marked divisible by 16 (Triton specializes
# each integer on it), which is what lets it vectorize the loads they address and pipeline them as
# cp.async. Counts of rows, tokens and chunks vary per launch and are left unmarked.
MODEL_DIMS = frozenset({"N", "K", "GROUP", "n_cols", "vocab"})
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def signature(kernel, dtype: str, pointers: dict[str, str]) -> dict[str, str]:
    def arg_type(name: str, param) -> str:
        if param.is_constexpr:
            return "constexpr"
        if name.endswith("_ptr"):
            return pointers.get(name) or POINTER_TYPES.get(name, f"*{dtype}")
        return "fp32" if name in FLOAT_SCALARS else "i32"

    return {name: arg_type(name, param) for name, param in zip(kernel.arg_names, kernel.params, strict=True)}


def runtime_attrs(kernel, types: dict[str, str]) -> dict:
    """The specialization the runtime gives a typical launch: pointers 16-byte aligned (torch's
    allocations, and the q/k/v slices of a fused projection's output), strides and model dimensions
    divisible by 16, except where the kernel opts out (do_not_specialize, do_not_specialize_on_alignment).
    Without it the build is the rare unaligned one, with scalar loads and no async copies."""
    opted_out = {kernel.arg_names[i] if isinstance(i, int) else i
                 for i in (*kernel.do_not_specialize, *kernel.do_not_specialize_on_alignment)}

    def aligned(name: str) -> bool:
        if name in opted_out:
            return False
        if types[name].startswith("*"):
            return True
        return types[name] == "i32" and ("stride" in name or name in MODEL_DIMS)

    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if aligned(name)}


def build(spec: tuple, dtype: str = "bf16", overrides: dict | None = None):
    """The compiled kernel of a case spec (sm90_cases.cases()'s value) for sm_90, its float arguments in
    `dtype` ("bf16" or "fp32"), constexprs and launch options overridden by `overrides`."""
    kernel, constexprs, *rest = spec
    pointers, options = (list(rest) + [{}, {}])[:2]  # pointer types, launch options (num_warps, ...)
    options = dict(options)
    # A constexpr a case leaves out takes its default (the source build knows no defaults).
    values = {name: param.default for name, param in zip(kernel.arg_names, kernel.params)
              if param.is_constexpr and param.default is not inspect.Parameter.empty}
    values.update(constexprs)
    if dtype == "fp32" and "DOT_PRECISION" in values:
        values["DOT_PRECISION"] = "ieee"  # what float32 runs use
    if dtype == "fp32" and "TILES" in values:
        values["TILES"] = "cast"  # decode_words.tile_form's for a float32 q
        values["KV_PER_PROG"] = 1  # which takes one KV head a program (DecodeCall.prepare)
    for key, value in (overrides or {}).items():
        (options if key in LAUNCH_OPTIONS else values)[key] = value
    types = signature(kernel, dtype, pointers)
    source = ASTSource(fn=kernel, signature=types, attrs=runtime_attrs(kernel, types),
                       constexprs={(kernel.arg_names.index(k),): v for k, v in values.items()})
    return triton.compile(source, target=H200, options=options)


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """The output of the cuobjdump beside Triton's ptxas on a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """Registers a thread (REG), its stack frame (STACK: bytes spilled to local memory, ~HBM latency on a
    miss), and static shared memory (SHARED) of a cubin's kernel."""
    usage = cuobjdump(cubin, "-res-usage")
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}


def instructions(cubin: bytes) -> list[tuple[int, str, str]]:
    """The SASS as (address, opcode, text), predicates dropped from the opcode."""
    found = []
    for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", cuobjdump(cubin, "-sass")):
        opcode = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text)
        if opcode:
            found.append((int(address, 16), opcode.group(1), text))
    return found


def loops(sass: list[tuple[int, str, str]]) -> list[tuple[int, int, collections.Counter]]:
    """Each backward branch's body: (start, end, its instructions by opcode)."""
    found = []
    for end, opcode, text in sass:
        target = re.search(r"0x([0-9a-f]+)\s*$", text) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < end:
            start = int(target.group(1), 16)
            found.append((start, end, collections.Counter(op for a, op, _ in sass if start <= a <= end)))
    return found


def report(case: str, overrides: dict) -> str:
    compiled = build(cases()[case], "bf16", overrides)
    cubin = compiled.asm["cubin"]
    sass = instructions(cubin)
    lines = [f"{case} {overrides or ''}: " + " ".join(f"{k} {v}" for k, v in resources(cubin).items())
             + f", dynamic shared {compiled.metadata.shared}, {compiled.metadata.num_warps} warps,"
             f" {len(sass)} instructions",
             "mix: " + ", ".join(f"{op} {n}" for op, n in collections.Counter(op for _, op, _ in sass)
                                 .most_common(16))]
    for start, end, mix in loops(sass):
        lines.append(f"loop {start:#x}-{end:#x}: {sum(mix.values())} instructions: "
                     + ", ".join(f"{op} {n}" for op, n in mix.most_common(12)))
    return "\n".join(lines)


def parsed(value: str):
    if value.lstrip("-").isdigit():
        return int(value)
    return {"True": True, "False": False}.get(value, value)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in cases():
        sys.exit(f"usage: sm90_build.py CASE [KEY=VALUE ...]; CASE one of: {', '.join(cases())}")
    print(report(sys.argv[1], {k: parsed(v) for k, v in (arg.split("=", 1) for arg in sys.argv[2:])}))
