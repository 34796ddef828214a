"""Adapters that put nanovllm inside other frameworks (they import nanovllm; nanovllm never imports
them): ray.py for Ray Data."""
