"""Attention over the paged KV cache: the `Attention` layer each decoder layer holds, the per-step
metadata, and interchangeable backends that each do q/k-norm + rotary + KV store + attend in one call."""
