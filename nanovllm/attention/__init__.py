"""Attention over the paged KV cache: per-step metadata, and interchangeable backends."""
