"""Whole-engine greedy decoding with every step of up to 16 tokens through the few-token kernels
(SkinnyLinearMethod's: the one-row GEMV, the few-row GEMV and the rows kernel, the norms and the SiLU-mul
folded in, the LM head at one row; in Triton's interpreter on the CPU, in float32) gives the plain path's
tokens at decode batches of 4, 3, 2 and 1 rows, the rows kernel's plain launches split in two and summed
by each column block's last split (the layer's counters, linear_methods.SPLIT_COUNTERS on); so does the
one-row bucket with the SiLU-mul folded into gate/up's GEMV as its epilogue (linear_methods.GATED_EPILOGUE),
down_proj then plain."""

import dataclasses

import pytest
import torch
from conftest import PROMPTS, triton_test_device

from nanovllm import LLM, SamplingParams

pytest.importorskip("triton")

OPTIONS = dict(kvcache_block_size=4, max_model_len=128, max_num_seqs=8, dtype="float32", enforce_eager=True,
               num_kvcache_blocks=256, attention_backend="torch")
# Sequences leave one by one: decode batches of 4, then 3, then 2 rows, then 1.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 6, 8, 12)]


@pytest.mark.parametrize("gated", [False, True])
def test_few_token_kernels_give_the_plain_tokens(qwen3_dir, monkeypatch, gated):
    device = triton_test_device()
    plain = LLM(qwen3_dir, **OPTIONS)
    expected = [o["token_ids"] for o in plain.generate(PROMPTS[:4], PARAMS, use_tqdm=False)]
    plain.shutdown()

    from nanovllm.kernels import gemv_folds, skinny_gemm, skinny_rows
    from nanovllm.kernels.split_k import plan_split_k
    from nanovllm.layers import kernel_plan, linear_methods

    # The engine plans the kernels as on a GPU, on this device and in float32 (token-exact here).
    monkeypatch.setattr(kernel_plan, "SKINNY_DEVICE_TYPES", (device,))
    monkeypatch.setattr(kernel_plan, "SKINNY_DTYPES", (torch.float32,))
    monkeypatch.setattr(linear_methods, "SPLIT_COUNTERS", True)
    method = linear_methods.SkinnyLinearMethod  # each way, whatever GATED_EPILOGUE says
    one_row = dataclasses.replace(method.BUCKETS[0], gated=linear_methods.gemv_gated if gated else None,
                                  normed_gated=linear_methods.gemv_norm_gated if gated else None)
    monkeypatch.setattr(method, "BUCKETS", (one_row, *method.BUCKETS[1:]))
    rows_seen, launch_rows = [], skinny_rows.launch_rows
    folds_seen, launch_gemv = [], skinny_gemm.launch_gemv

    def spy(x, *args, **kwargs):  # args: weight, bias, out, config[, pdl, prologue, ...]
        prologue = kwargs.get("prologue", args[5] if len(args) > 5 else skinny_rows.PLAIN)
        rows_seen.append((x.shape[0], prologue.value))
        if prologue == skinny_rows.PLAIN:  # split in two, the sums left to the layer's counters
            assert kwargs["counters"] is args[0].split_counters and not kwargs["counters"].any()
            args = (*args[:3], dataclasses.replace(args[3], block_k=16, split_k=2), *args[4:])
            assert plan_split_k(x.shape[1], 16, 2).splits == 2
        return launch_rows(x, *args, **kwargs)

    def spy_folds(x, *args, **kwargs):  # args: weight, bias, out, config, pdl[, prologue, ...]
        prologue = args[5] if len(args) > 5 else kwargs.get("prologue", skinny_gemm.PLAIN)
        folds_seen.append((prologue.value, kwargs.get("gated", False)))
        return launch_gemv(x, *args, **kwargs)

    monkeypatch.setattr(skinny_rows, "launch_rows", spy)
    monkeypatch.setattr(gemv_folds, "launch_gemv", spy_folds)
    llm = LLM(qwen3_dir, **OPTIONS)
    assert [o["token_ids"] for o in llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)] == expected
    llm.shutdown()
    assert {m for m, _ in rows_seen} >= {2, 3, 4}
    assert {p for _, p in rows_seen} >= {skinny_rows.PLAIN.value, skinny_rows.ADD_RMS_NORM.value}
    # One row: gate/up folds the norm (and, gated, the SiLU-mul after it); down_proj folds the SiLU-mul only
    # where gate/up did not
    assert ((skinny_gemm.ADD_RMS_NORM.value, True) in folds_seen) == gated
    assert ((skinny_gemm.SILU_MUL.value, False) in folds_seen) != gated
