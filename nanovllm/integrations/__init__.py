"""Adapters that put nanovllm inside or behind other frameworks (they import nanovllm; nanovllm never
imports them): ray.py for Ray Data, lm_eval.py for lm-evaluation-harness. Each is an optional extra and
imported only on request."""
