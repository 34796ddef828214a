"""Adapters that put nanovllm behind other tools' interfaces (lm-evaluation-harness). Each is an
optional extra and imported only on request."""
