"""Qwen3-MoE gives transformers' greedy output token for token (float32, CPU), with prefix caching,
chunked prefill, preemption and TP=2 over gloo; expert weights load from per-expert and from stacked
(GGUF-style) names, and a checkpoint missing one expert's tensor is rejected naming it."""

import json
import os
import shutil

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS, hf_greedy, make_model_dir
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen3MoeConfig

from nanovllm import LLM, SamplingParams
from nanovllm.layers.fused_moe import SparseMoeBlock
from nanovllm.models.decoder import DecoderMLP
from nanovllm.utils.moe_layout import is_sparse_layer

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 8 experts, top-2, renormalised; layer 1 of 3 keeps a dense MLP.
MOE = dict(arch="qwen3_moe", num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)
# float32 also where a GPU is shown (the engine's default there is bfloat16), so that greedy tokens match.
ENGINE = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512,
              dtype="float32")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(folder, transformers' greedy tokens for PROMPTS)."""
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    hf = make_model_dir(path, **MOE)
    hf.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(path)
    return path, [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in PROMPTS]


def token_ids(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    config = Qwen3MoeConfig(num_hidden_layers=6, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_sparse_layer(config, i) for i in range(6)] == [False, True, False, False, False, True]


def test_greedy_matches_transformers_with_prefix_cache_and_preemption(moe):
    path, reference = moe
    # 14 blocks of 4 tokens: every request fits alone, all four together do not (preemption).
    llm = LLM(path, **ENGINE, num_kvcache_blocks=14)
    layers = llm.engine.executor.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SparseMoeBlock, DecoderMLP, SparseMoeBlock]
    assert token_ids(llm) == reference
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    hits = scheduler.block_manager.num_cache_hit_tokens
    assert token_ids(llm) == reference
    assert scheduler.block_manager.num_cache_hit_tokens > hits


def test_chunked_prefill_keeps_output(moe):
    path, reference = moe
    llm = LLM(path, **{**ENGINE, "max_num_batched_tokens": 5})
    (output,) = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert len(output["prompt_token_ids"]) > 10  # several chunks of <= 5 tokens
    assert output["token_ids"] == reference[1]


def test_tp2_matches_transformers(moe):
    path, reference = moe
    with LLM(path, **ENGINE, tensor_parallel_size=2, device="cpu") as llm:  # gloo, on any machine
        assert token_ids(llm) == reference


def test_triton_path_matches_transformers(moe, monkeypatch):
    """The GPU path (Triton routing and experts, here in the interpreter on CPU tensors) inside the
    whole engine."""
    pytest.importorskip("triton")
    from nanovllm.kernels.fused_moe import fused_moe
    from nanovllm.kernels.moe_routing import topk_softmax
    from nanovllm.layers import fused_moe as moe_layer
    from nanovllm.layers.fused_moe import MoEExperts

    calls = []

    def triton_forward(self, x, topk_weights, topk_ids):
        calls.append(x.shape[0])
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    monkeypatch.setattr(MoEExperts, "forward", triton_forward)
    monkeypatch.setattr(moe_layer, "route", topk_softmax)
    path, reference = moe
    llm = LLM(path, **ENGINE)
    few = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)  # the interpreter is slow
    outputs = llm.generate(PROMPTS[:2], few, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [ref[:8] for ref in reference[:2]]
    assert calls and max(calls) > 16  # the prefill batch spans several 16-row blocks


def _rewrite_checkpoint(src: str, dst: str, rewrite) -> None:
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    save_file(rewrite(load_file(file)), file, metadata={"format": "pt"})


def test_stacked_expert_names_load_like_per_expert_ones(moe, tmp_path):
    """GGUF files come through transformers as one [E, 2I, H] gate_up and one [E, H, I] down tensor."""
    path, reference = moe

    def stack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in tensors.items() if ".experts." not in k}
        for layer in (0, 2):
            prefix = f"model.layers.{layer}.mlp.experts"
            per = {p: torch.stack([tensors[f"{prefix}.{e}.{p}.weight"] for e in range(8)])
                   for p in ("gate_proj", "up_proj", "down_proj")}
            out[f"{prefix}.gate_up_proj"] = torch.cat([per["gate_proj"], per["up_proj"]], dim=1)
            out[f"{prefix}.down_proj"] = per["down_proj"]
        return out

    _rewrite_checkpoint(path, tmp_path / "stacked", stack)
    llm = LLM(str(tmp_path / "stacked"), **ENGINE)
    assert token_ids(llm, PROMPTS[:2]) == reference[:2]


def test_missing_expert_tensor_is_reported(moe, tmp_path):
    path, _ = moe
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    _rewrite_checkpoint(path, tmp_path / "partial", lambda t: {k: v for k, v in t.items() if k != missing})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*" + missing.replace(".", r"\.")):
        LLM(str(tmp_path / "partial"), **ENGINE)


def test_dummy_weights_and_tensor_parallel_sizes(moe, tmp_path):
    path, _ = moe
    llm = LLM(path, **ENGINE, load_format="dummy")
    assert len(token_ids(llm, PROMPTS[:1])[0]) == MAX_TOKENS
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    os.makedirs(tmp_path / "odd")
    with open(tmp_path / "odd" / "config.json", "w") as f:
        json.dump({**config, "moe_intermediate_size": 30}, f)
    with pytest.raises(ValueError, match=r"moe_intermediate_size 30.*valid sizes: \[1, 2\]"):
        LLM(str(tmp_path / "odd"), tensor_parallel_size=4, skip_tokenizer_init=True, load_format="dummy")


# Hugging Face parameter (under model.layers.N.) -> llama.cpp tensor (under blk.N.)
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(hf, path: str) -> None:
    """A float32 GGUF of `hf` as llama.cpp's converter writes a Qwen3-MoE model (no tokenizer)."""
    pytest.importorskip("gguf")
    from gguf_files import finish_gguf, start_gguf

    c, sd = hf.config, {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = start_gguf(path, "qwen3moe", c)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in GGUF_LAYER_NAMES.items():
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", sd[f"model.layers.{i}.{hf_name}.weight"])
        gate_up, width = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"], c.moe_intermediate_size
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :width].copy())
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", gate_up[:, width:].copy())
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[f"model.layers.{i}.mlp.experts.down_proj"])
    finish_gguf(w)


def test_gguf_matches_transformers(tmp_path):
    """transformers reads qwen3moe GGUF files but not the experts' width; nanovllm takes it from the
    file (32 here, not Qwen3MoeConfig's default 768). llama.cpp's qwen3moe has no dense layers."""
    moe = {k: v for k, v in MOE.items() if k != "mlp_only_layers"}
    hf = make_model_dir(str(tmp_path), **{**moe, "num_hidden_layers": 2})
    hf.generation_config.eos_token_id = None
    write_qwen3moe_gguf(hf, str(tmp_path / "tiny.gguf"))
    prompts = [[5, 17, 99, 3, 250], [7]]
    llm = LLM(str(tmp_path / "tiny.gguf"), skip_tokenizer_init=True, **ENGINE)
    assert llm.config.hf_config.moe_intermediate_size == 32
    assert token_ids(llm, prompts) == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
