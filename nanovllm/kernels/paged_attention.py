"""Attention over the paged KV cache: one import point for the two Triton kernels.

`paged_prefill_attention` (causal, varlen, over cached prefixes) lives in prefill_attention.py and
`paged_decode_attention` (one query per sequence, split-KV) in decode_attention.py; both read K/V
through block tables with any block_size, support GQA, and accumulate in float32.
"""

from nanovllm.kernels.decode_attention import decode_num_splits, paged_decode_attention
from nanovllm.kernels.kv_cache import store_kvcache
from nanovllm.kernels.prefill_attention import paged_prefill_attention

__all__ = ["decode_num_splits", "paged_decode_attention", "paged_prefill_attention", "store_kvcache"]
