"""Triton kernels for the paged KV cache: store new K/V (`kv_cache`), prefill and decode attention
over paged K/V (`paged_attention`); decode-sized matmuls (`skinny_gemm`); mixture-of-experts routing
(`moe_routing`) and experts (`fused_moe`).

Importing this package imports nothing else: the kernel modules import Triton at their top, and the
engine imports them lazily (on GPU, or in tests under TRITON_INTERPRET=1), so CPU-only installs work.
"""
