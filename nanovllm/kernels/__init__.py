"""Triton kernels: q/k-norm + rotary + KV store (`rope_store`), prefill and decode attention over the
paged KV cache (`prefill_attention`, `decode_attention`), one-token matmuls (`skinny_gemm`),
mixture-of-experts routing (`moe_routing`) and experts (`fused_moe`), and what they share (`common`);
and one CUDA kernel, compiled at run time by NVRTC (`nvrtc`): one-row decode attention
(`cuda_decode_rope`, decode_rope_one_row.cu).

Importing this package imports nothing else: the kernel modules import Triton at their top, and the
engine imports them only when a GPU backend is chosen (or in tests under TRITON_INTERPRET=1), so
CPU-only installs work.
"""
