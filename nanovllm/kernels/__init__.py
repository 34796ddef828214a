"""Triton kernels for the paged KV cache: store new K/V (`kv_cache`), prefill and decode attention
over paged K/V (`paged_attention`).

Importing this package imports nothing else: the kernel modules import Triton at their top, and the
engine imports them lazily (on GPU, or in tests under TRITON_INTERPRET=1), so CPU-only installs work.
"""
