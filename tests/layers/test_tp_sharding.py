"""Each rank's shard, built by the layers' weight loaders, is the matching slice of the unsharded
tensor: checkpoint weights and dummy weights alike (dummy weights must not depend on the number of
ranks, or TP=2 and TP=1 runs would compare different models). No processes: the layers only need a
rank and a size while they are built."""

from types import SimpleNamespace

import pytest
import torch
from conftest import make_model_dir

from nanovllm.layers.parallel import use_tp_group
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.loader import init_dummy_weights, load_model

TP = 2


def build(hf_config, rank: int, size: int, path: str | None) -> dict[str, torch.Tensor]:
    with use_tp_group(SimpleNamespace(rank=rank, world_size=size) if size > 1 else None):
        model = Qwen3ForCausalLM(hf_config)
    if path is None:
        init_dummy_weights(model, std=0.5, seed=3)
    else:
        load_model(model, path)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 1], ids=["kv_heads_split", "kv_heads_replicated"])
def model_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"qwen3_kv{request.param}"))
    hf = make_model_dir(path, num_key_value_heads=request.param, vocab_size=401)  # 401: padded shards
    return path, hf.config


@pytest.mark.parametrize("source", ["checkpoint", "dummy"])
def test_shards_reassemble_the_unsharded_weights(model_dir, source):
    path, hf_config = model_dir
    path = path if source == "checkpoint" else None
    full = build(hf_config, 0, 1, path)
    shards = [build(hf_config, rank, TP, path) for rank in range(TP)]
    heads, kv_heads, head_dim = 4, hf_config.num_key_value_heads, 16
    q, kv = heads * head_dim, kv_heads * head_dim
    for name, whole in full.items():
        parts = [s[name] for s in shards]
        if name.endswith("qkv_proj.weight"):
            # per rank: [q: heads/TP | k: max(kv_heads/TP, 1) | v: same] heads of head_dim rows
            q_rank, kv_rank = q // TP, max(kv_heads // TP, 1) * head_dim
            torch.testing.assert_close(torch.cat([p[:q_rank] for p in parts]), whole[:q], rtol=0, atol=0)
            for offset, start in ((q_rank, q), (q_rank + kv_rank, q + kv)):  # k, then v
                rank_parts = [p[offset:offset + kv_rank] for p in parts]
                if kv_heads >= TP:
                    torch.testing.assert_close(torch.cat(rank_parts), whole[start:start + kv], rtol=0, atol=0)
                else:  # one K/V head, replicated on every rank
                    for part in rank_parts:
                        torch.testing.assert_close(part, whole[start:start + kv], rtol=0, atol=0)
        elif name.endswith("gate_up_proj.weight"):
            half = whole.shape[0] // 2
            gate, up = [p[:half // TP] for p in parts], [p[half // TP:] for p in parts]
            torch.testing.assert_close(torch.cat(gate), whole[:half], rtol=0, atol=0)
            torch.testing.assert_close(torch.cat(up), whole[half:], rtol=0, atol=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=0, atol=0)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = torch.cat(parts)
            assert padded.shape[0] == 402
            torch.testing.assert_close(padded[:401], whole, rtol=0, atol=0)
            assert not padded[401:].any()
        else:  # norms: replicated
            for p in parts:
                torch.testing.assert_close(p, whole, rtol=0, atol=0)


def test_dummy_weights_depend_on_the_seed(model_dir):
    _, hf_config = model_dir
    with torch.no_grad():
        a, b = Qwen3ForCausalLM(hf_config), Qwen3ForCausalLM(hf_config)
        init_dummy_weights(a, seed=1)
        init_dummy_weights(b, seed=2)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
