"""How a linear layer computes: the method object each layer holds (vLLM's `quant_method`), chosen once
when the engine builds the model (layers/kernel_plan.py). A method owns its weights' layout
(`create_weights`, then `process_weights_after_loading`) and which kernel a call takes by its row count:
one declared table of row buckets (`BUCKETS`, the first that fits), with the evidence beside it.

The decoder's RMSNorm and SiLU-mul fold into the projection after them where the call's bucket has a
kernel for it (`apply_normed`, `apply_silu`); elsewhere the method runs the norm or the activation first.
Or the SiLU-mul folds into the gate/up projection before it, as its epilogue (`apply_gated`), where that
projection's bucket has such a kernel: then down_proj runs plain.
A quantized method (block-scaled fp8 weights, say) is another subclass of LinearMethod with its own
weights, scales and table: the layers do not change. The GPU kernels are imported when first called, so
this module needs no Triton."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.norm_act import RMSNorm, silu_and_mul

# (x [M, K], *weights, bias [N] | None, pdl) -> x @ weight^T (+ bias). weights: LinearMethod.weights, the
# weight [N, K] (and a quantized method's scales after it).
Kernel = Callable[..., torch.Tensor]
# (x, norm_weight, eps, *weights, bias, residual, pdl)
#     -> (rms_norm(x + residual) @ weight^T (+ bias), x + residual)
NormedKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# ([gate | up] [M, 2K], *weights, bias, pdl) -> (silu(gate) * up) @ weight^T (+ bias)
SiluKernel = Kernel
# (x, *weights, bias, pdl) -> silu(gate) * up of x @ [gate; up]^T (+ bias): a GatedKernel; and its normed
# form (x, norm_weight, eps, *weights, bias, residual, pdl) -> (that of rms_norm(x + residual), x + residual)
GatedKernel = Kernel

# Whether bf16's one-row GEMV bucket folds the SiLU-mul into gate/up's kernel as its epilogue
# (kernels/gemv_folds.py, `gated_forms`) rather than into down_proj's prologue, where every program of down
# recomputes it (284 instructions a warp a K tile against 149 plain at Qwen3-8B's 8 x 512 tiles, sm_90
# SASS); the epilogue adds no instruction to gate/up's loop. One stream on an H100 (2026-12-05, engine code
# 59fc20b with the switch flipped in the call's copy): Qwen3-0.6B 0.857 / 0.849 -> 0.827 / 0.810 ms a
# token, Qwen3-8B 5.867 -> 5.753. fp8's one-row buckets decide apart (fp8_methods.FP8_GATED_EPILOGUE: off).
GATED_EPILOGUE = True
# Whether layers get split-K arrival counters (add_split_counters), so that the few-row kernels' splits sum
# their partials themselves instead of in a second launch. Qwen3-8B with fp8 weights, one H100, 2026-12-06,
# each way twice in one call (`scripts/stream_latency.py --streams N --output-len 256`): 16 streams 5.404 /
# 5.400 ms a step against 5.480 / 5.492 (-1.6%), 4 streams 4.648 against 4.690 (-0.9%). Their GPU tests
# pass (CUDA-graph replays at Qwen3-8B's splits).
SPLIT_COUNTERS = True


@dataclass(frozen=True, slots=True)
class Bucket:
    """The kernels of calls of up to max_rows rows (None: any number)."""

    max_rows: int | None
    plain: Kernel
    normed: NormedKernel | None = None  # the RMSNorm folded in; None: the norm's own kernel, then plain
    silu: SiluKernel | None = None  # the SiLU-mul folded in; None: the SiLU-mul's own kernel, then plain
    # A gate/up projection's SiLU-mul after it folded in (without and with the norm before it); None: the
    # SiLU-mul runs with down_proj (its `silu`, or its own kernel)
    gated: GatedKernel | None = None
    normed_gated: NormedKernel | None = None


# The kernels, under the names the kernel table prints (kernel_plan.kernel_table).
def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    return F.linear(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    from nanovllm.kernels.skinny_gemm import skinny_linear
    return skinny_linear(x, weight, bias, pdl=pdl)


def gemv_norm(x, norm_weight, eps, weight, bias, residual, pdl) -> tuple[torch.Tensor, torch.Tensor]:
    from nanovllm.kernels.gemv_folds import skinny_norm_linear
    return skinny_norm_linear(x, norm_weight, eps, weight, bias, residual, pdl)


def gemv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    from nanovllm.kernels.gemv_folds import skinny_silu_linear
    return skinny_silu_linear(x, weight, bias, pdl=pdl)


def gemv_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    from nanovllm.kernels.gemv_folds import skinny_gated_linear
    return skinny_gated_linear(x, weight, bias, pdl)


def gemv_norm_gated(x, norm_weight, eps, weight, bias, residual, pdl) -> tuple[torch.Tensor, torch.Tensor]:
    from nanovllm.kernels.gemv_folds import skinny_norm_linear
    return skinny_norm_linear(x, norm_weight, eps, weight, bias, residual, pdl, gated=True)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    from nanovllm.kernels.gemv_rows import gemv_rows_linear
    return gemv_rows_linear(x, weight, bias, pdl=pdl)


def gemv_rows_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool
                   ) -> torch.Tensor:
    from nanovllm.kernels.gemv_rows import gemv_rows_silu_linear
    return gemv_rows_silu_linear(x, weight, bias, pdl=pdl)


def mma_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    from nanovllm.kernels.skinny_rows import rows_linear
    return rows_linear(x, weight, bias, pdl=pdl, counters=getattr(weight, "split_counters", None))


def add_split_counters(layer: nn.Module) -> None:
    """Give the layer's weight [N, K] its split-K arrival counters (int32 zeros [N], weight.split_counters):
    the few-row kernels' splits then sum their partials themselves, no second launch (kernels/split_k.py).
    The layer's own, so that no two layers, models or engines share them. Nothing unless SPLIT_COUNTERS."""
    if not SPLIT_COUNTERS:
        return
    layer.weight.split_counters = torch.zeros(layer.weight.shape[0], dtype=torch.int32,
                                              device=layer.weight.device)


def mma_rows_norm(x, norm_weight, eps, weight, bias, residual, pdl) -> tuple[torch.Tensor, torch.Tensor]:
    from nanovllm.kernels.skinny_rows import rows_norm_linear
    return rows_norm_linear(x, norm_weight, eps, weight, bias, residual, pdl)


def rms_norm_kernel(x, weight, eps, residual, pdl=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) through kernels/norm_act.py (a GPU method's calls are CUDA's;
    pdl: a programmatic dependent launch)."""
    from nanovllm.kernels import norm_act
    if residual is None:
        return norm_act.rms_norm(x, weight, eps, pdl), x
    return norm_act.add_rms_norm(x, residual, weight, eps, pdl)


def norm_first(plain: Kernel) -> NormedKernel:
    """A bucket's norm fold that is two kernels: the RMSNorm's own, then `plain`, both launched as
    programmatic dependents under pdl, so that the norm starts while the kernel before it ends and `plain`
    loads its first weight tiles while the norm runs (for kernels a folded prologue slows: fp8's GEMVs)."""

    def kernel(x, norm_weight, eps, *args):  # args: *weights, bias, residual, pdl
        *weights, bias, residual, pdl = args
        normed, summed = rms_norm_kernel(x, norm_weight, eps, residual, pdl)
        return plain(normed, *weights, bias, pdl), summed

    kernel.__name__ = f"{plain.__name__}_norm"
    return kernel


def gated_forms(enabled: bool, gated: GatedKernel, normed_gated: NormedKernel | None = None
                ) -> tuple[GatedKernel | None, NormedKernel | None]:
    """A one-row bucket's (gated, normed_gated) where `enabled` (a method's switch), else (None, None); the
    normed form is the norm's own kernel, then `gated` (norm_first), unless given."""
    if not enabled:
        return None, None
    return gated, normed_gated or norm_first(gated)


def silu_first(plain: Kernel) -> SiluKernel:
    """A bucket's SiLU-mul fold that is two kernels, chained as norm_first's."""

    def kernel(x, *args):  # args: *weights, bias, pdl
        from nanovllm.kernels import norm_act
        *weights, bias, pdl = args
        return plain(norm_act.silu_and_mul(x, pdl), *weights, bias, pdl)

    kernel.__name__ = f"{plain.__name__}_silu"
    return kernel


class LinearMethod:
    """What a linear layer asks of its method. `layer` is the module (layers/linear.py) whose
    parameters the method created; `bias` is the bias to add in the matmul (None where the layer adds
    it after its all-reduce)."""

    BUCKETS: tuple[Bucket, ...] = ()

    def __init__(self, pdl: bool = False) -> None:
        self.pdl = pdl  # launch the GPU kernels as programmatic dependents (sm_90+)
        buckets = self.BUCKETS
        name = type(self).__name__
        assert buckets and buckets[-1].max_rows is None, f"{name}'s last bucket must take any rows"
        largest = max((b.max_rows for b in buckets[:-1]), default=0)
        # Row count -> bucket, precomputed so that a call costs one index. No rows: the unbounded bucket
        # (nothing to stream; the folded kernels take at least one row).
        self._at = (buckets[-1], *(next(b for b in buckets if b.max_rows is None or rows <= b.max_rows)
                                   for rows in range(1, largest + 1)), buckets[-1])

    def bucket(self, rows: int) -> Bucket:
        at = self._at
        return at[rows] if rows < len(at) else at[-1]

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       weight_loader: Callable[..., None]) -> None:
        """Register this rank's weight parameters on `layer` (input/output sizes are this rank's), each
        loaded through `weight_loader`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Re-lay the loaded weights out as the kernels want them (e.g. quantize, transpose). Nothing by
        default."""

    def weights(self, layer: nn.Module) -> tuple:
        """What the kernels take between x and the bias: the weight, and a quantized method's scales
        (layers/fp8.py: weight, weight_scale, group)."""
        return (layer.weight,)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ weight^T (+ bias) -> [M, N], by the kernel of x's row bucket."""
        at, rows = self._at, x.shape[0]
        return (at[rows] if rows < len(at) else at[-1]).plain(x, *self.weights(layer), bias, self.pdl)

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply(norm(x + residual)), x + residual), or without a residual (apply(norm(x)), x): one
        kernel where the bucket folds the norm in."""
        at, rows = self._at, x.shape[0]
        fold = (at[rows] if rows < len(at) else at[-1]).normed
        if fold is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            return fold(x, norm.weight, norm.eps, *self.weights(layer), layer.bias, residual, self.pdl)
        if residual is None:
            return self.apply(layer, norm(x), layer.bias), x
        normed, residual = norm(x, residual)
        return self.apply(layer, normed, layer.bias), residual

    def apply_silu(self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """apply(silu(gate) * up) of the gated MLP's [gate | up] [M, 2K]: one kernel where the bucket
        folds the SiLU-mul in."""
        at, rows = self._at, gate_up.shape[0]
        fold = (at[rows] if rows < len(at) else at[-1]).silu
        if fold is not None and gate_up.is_contiguous():
            return fold(gate_up, *self.weights(layer), bias, self.pdl)
        return self.apply(layer, silu_and_mul(gate_up), bias)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm | None,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(silu(gate) * up of the gated MLP's [gate | up] = apply(x), None), or given the norm before it
        (that of apply(norm(x + residual)), x + residual) (x without a residual): one kernel, where x's
        bucket has it. None where it has not: the caller runs apply (apply_normed), then the SiLU-mul."""
        at, rows = self._at, x.shape[0]
        bucket = at[rows] if rows < len(at) else at[-1]
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return None
        if norm is None:
            return None if bucket.gated is None else (bucket.gated(x, *self.weights(layer), layer.bias,
                                                                   self.pdl), None)
        if bucket.normed_gated is None:
            return None
        return bucket.normed_gated(x, norm.weight, norm.eps, *self.weights(layer), layer.bias, residual,
                                   self.pdl)


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model's dtype, every call through torch (cuBLAS on a GPU): the CPU's method,
    float32 models', and the GPU's with Config(skinny_gemm=False)."""

    BUCKETS = (Bucket(None, torch_linear),)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       weight_loader: Callable[..., None]) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = weight_loader


class SkinnyLinearMethod(UnquantizedLinearMethod):
    """Dense bfloat16/float16 weights on CUDA, decode-sized calls through the project's Triton kernels,
    each of which streams the weight once (a matmul of a few rows is a read of its weight). Measured on
    an H200 at Qwen3-0.6B's shapes (docs/performance-notes.md, section "Decode GEMMs and GEMVs"):

    - 1 row: cuBLAS reaches a third to two thirds of the memory bandwidth; the GEMV (kernels/skinny_gemm.py)
      streams it 1.1-3.7x faster, the RMSNorm or the SiLU-mul before it folded in (commits 70bf6b1 and
      e75034f, 2026-11-30).
    - 2 rows: the few-row GEMV (kernels/gemv_rows.py): o_proj 96 us against the rows kernel's 138 and
      down_proj with its SiLU-mul 146 against 210-300 (28 calls each); q/k/v and gate/up with their norm
      folded in stay on the rows kernel, 180 and 198 against the GEMV's 199 and 236; a two-row decode step
      990-995 us against 1,060-1,064 (commit 3b5c364, 2026-12-01).
    - 3-16 rows: the rows kernel on tensor cores (kernels/skinny_rows.py), the norm folded in: decode
      graphs 9-17% faster than cuBLAS with separate norm kernels; the SiLU-mul does not fold there (every
      column block recomputing it for 16 rows: 257 against 211 us for 28 calls) (commit adbf98d, 2026-12-01).
    - More rows are compute-bound enough for cuBLAS."""

    BUCKETS = (
        Bucket(1, gemv, gemv_norm, gemv_silu, *gated_forms(GATED_EPILOGUE, gemv_gated, gemv_norm_gated)),
        Bucket(2, gemv_rows, mma_rows_norm, gemv_rows_silu),
        Bucket(16, mma_rows, mma_rows_norm),
        Bucket(None, torch_linear),
    )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        add_split_counters(layer)


class SkinnyLMHeadMethod(SkinnyLinearMethod):
    """The LM head's: the GEMV at one row only. From two rows cuBLAS reads its wide weight (311 MB for
    Qwen3's vocabulary) at ~3.9 TB/s, 78-81 us at 2-16 rows on an H200, where the rows kernel took 80-134
    (docs/performance-notes.md, section "Decode GEMMs and GEMVs"; commit 2bb6672, 2026-12-01)."""

    BUCKETS = (Bucket(1, gemv), Bucket(None, torch_linear))
