"""The OpenAI-compatible server: `nanovllm serve MODEL` or `python -m nanovllm.serve MODEL`
(needs the `serve` extra: pip install -e ".[serve]")."""
