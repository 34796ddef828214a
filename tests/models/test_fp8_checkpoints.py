"""fp8 models end to end (float32, CPU): a block-wise (Qwen3-*-FP8's layout), a per-channel and a per-tensor
fp8 checkpoint of the tiny Qwen3 give the prompt logprobs and greedy tokens of transformers running the very
weights they dequantize to with the same W8A8 activation rounding (each decoder projection's input through
e4m3 and back, per token and group); `quantization="fp8"` quantizes the float32 checkpoint alike; MoE
experts load and run from a block-wise checkpoint; TP=2 shards the scales as TP=1 holds them; the same
weights and scales in compressed-tensors' layout (llm-compressor's FP8 checkpoints) give the very outputs;
checkpoints with static (calibrated) activation scales give transformers' outputs with that rounding;
ModelOpt's layouts (NVIDIA's FP8 checkpoints) give the outputs of the fp8 checkpoints they equal.

The tiny random model amplifies rounding (INIT_RANGE 0.25): against the unquantized model its prompt
logprobs move by ~0.2 nats on average with fp8, so the comparisons that must hold exactly are the ones with
the same rounding."""

import json
import shutil

import pytest
import torch
from conftest import PROMPTS, make_model_dir
from fp8_files import STATIC_INPUT_SCALES, write_fp8_checkpoint
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.layers.fp8 import Fp8LinearMethod, quantize_activations
from nanovllm.layers.fp8_static import Fp8StaticLinearMethod, quantize_static

pytestmark = pytest.mark.usefixtures("one_thread")
# The CPU (TP=2 over gloo too) and float32, with a GPU shown as well: these tests check that checkpoints
# are read exactly, through the reference's roundings; the GPU kernels have their own tests against it
# (tests/kernels/test_fp8_kernels.py), whose decode GEMV does not round activations.
ENGINE = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512,
              device="cpu", dtype="float32")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
# float32 on both sides, the same roundings: only the order of the float32 sums differs.
TOL = 2e-3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = str(root / "fp32")
    make_model_dir(src)
    for layout in ("block", "channel", "tensor"):
        write_fp8_checkpoint(src, str(root / layout), layout, dequantized=str(root / f"{layout}-dequantized"))
        write_fp8_checkpoint(src, str(root / f"ct-{layout}"), f"ct-{layout}")
    return root


def prompt_logprobs(llm: LLM) -> tuple[list[list[float]], list[list[int]]]:
    """Each prompt's tokens' logprobs (from the second), and the greedy tokens."""
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    lps = [[o["prompt_logprobs"][i][o["prompt_token_ids"][i]] for i in range(1, len(o["prompt_token_ids"]))]
           for o in outs]
    return lps, [o["token_ids"] for o in outs]


# A fused projection's static scale: the largest of its parts' (layers/fp8_static.py).
FUSED_STATIC_SCALES = {**STATIC_INPUT_SCALES, **dict.fromkeys(("q_proj", "k_proj", "v_proj"), 0.014),
                       **dict.fromkeys(("gate_proj", "up_proj"), 0.013)}


def static_rounding(name: str):
    """A pre-hook rounding a projection's input as a static checkpoint's scale for it does."""
    scale = torch.tensor([FUSED_STATIC_SCALES[name.split(".")[-1]]])
    return lambda m, args: ((quantize_static(args[0], scale).float() * scale).to(args[0].dtype),)


def static_experts(experts: torch.nn.Module):
    """transformers' Qwen3MoeExperts.forward (the same loop and sums) with each expert's inputs rounded as
    a static checkpoint's scales for that expert do: gate/up's the larger of theirs, times 1 + e / 10
    (fp8_files.static_input_scale)."""

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        scale = torch.tensor([scale])
        return (quantize_static(x, scale).float() * scale).to(x.dtype)

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)
        for e in range(experts.num_experts):
            top_k_pos, token_idx = torch.where(mask[e])
            if not len(token_idx):
                continue
            x = rounded(hidden_states[token_idx], FUSED_STATIC_SCALES["up_proj"] * (1 + e / 10))
            gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = rounded(experts.act_fn(gate) * up, STATIC_INPUT_SCALES["down_proj"] * (1 + e / 10))
            y = torch.nn.functional.linear(y, experts.down_proj[e])
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward


def w8a8_transformers(path: str, group: int | None, static: bool = False
                      ) -> tuple[list[list[float]], list[list[int]]]:
    """transformers on `path` with every decoder projection's input rounded through e4m3 (per token and
    group of `group` inputs; None: per token; static: with the static checkpoints' scales, MoE experts'
    each with its own): prompt logprobs and greedy tokens of PROMPTS."""
    from transformers import AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    def dynamic_rounding(m, args):
        return (quantize_activations(args[0], group or args[0].shape[-1]),)

    for name, module in hf.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("mlp.gate"):  # routers stay exact
            module.register_forward_pre_hook(static_rounding(name) if static else dynamic_rounding)
        elif name.endswith("mlp.experts") and static:
            module.forward = static_experts(module)
    hf.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(path)
    lps, tokens = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            logits = hf(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            lps.append([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            tokens.append(out[0, len(ids):].tolist())
    return lps, tokens


def max_error(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("layout, group", [("block", 128), ("channel", None), ("tensor", None)])
def test_fp8_checkpoint_matches_w8a8_transformers(folders, layout, group):
    llm = LLM(str(folders / layout), **ENGINE)
    layer = llm.engine.executor.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant_method, Fp8LinearMethod)
    assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    lps, tokens = prompt_logprobs(llm)
    ref_lps, ref_tokens = w8a8_transformers(str(folders / f"{layout}-dequantized"), group)
    assert max_error(lps, ref_lps) < TOL
    assert tokens == ref_tokens


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_compressed_tensors_checkpoint_runs_as_the_fp8_one(folders, layout):
    """llm-compressor's layout of the same e4m3 weights and scales (`weight_scale` [N, 1], [1] or per
    block; quant_method "compressed-tensors"): the same parameters once loaded, the same outputs."""
    fp8, ct = LLM(str(folders / layout), **ENGINE), LLM(str(folders / f"ct-{layout}"), **ENGINE)
    loaded = [llm.engine.executor.model.state_dict() for llm in (fp8, ct)]
    assert loaded[0].keys() == loaded[1].keys()
    assert all(torch.equal(loaded[0][name], loaded[1][name]) for name in loaded[0])
    assert prompt_logprobs(ct) == prompt_logprobs(fp8)


@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_static_activation_scales_match_transformers_with_that_rounding(folders, tmp_path, layout):
    """A checkpoint with a calibrated input_scale per projection (AutoFP8's layout; compressed-tensors'
    static per-tensor inputs the same, bit for bit): each projection's input through e4m3 at its scale
    (a fused one's: the largest of its parts'), as transformers does with that rounding."""
    src = str(folders / "fp32")
    write_fp8_checkpoint(src, str(tmp_path / "static"), layout, static=True,
                         dequantized=str(tmp_path / "dequantized"))
    write_fp8_checkpoint(src, str(tmp_path / "ct-static"), f"ct-{layout}", static=True)
    llm = LLM(str(tmp_path / "static"), **ENGINE)
    qkv = llm.engine.executor.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Fp8StaticLinearMethod) and qkv.input_scale.tolist() == [
        pytest.approx(0.014)]
    lps, tokens = prompt_logprobs(llm)
    ref_lps, ref_tokens = w8a8_transformers(str(tmp_path / "dequantized"), None, static=True)
    assert max_error(lps, ref_lps) < TOL and tokens == ref_tokens
    # the dynamic checkpoint of the same weights rounds otherwise
    assert max_error(lps, prompt_logprobs(LLM(str(folders / layout), **ENGINE))[0]) > 10 * TOL
    assert prompt_logprobs(LLM(str(tmp_path / "ct-static"), **ENGINE)) == (lps, tokens)


@pytest.mark.parametrize("layout, static", [("tensor", True), ("channel", False)])
@pytest.mark.parametrize("legacy", [False, True], ids=["config.json", "hf_quant_config.json"])
def test_modelopt_checkpoint_runs_as_the_fp8_one(folders, tmp_path, layout, static, legacy):
    """ModelOpt's layouts of the same e4m3 weights and scales (quant_algo "FP8": per-tensor weights, static
    inputs; "FP8_PER_CHANNEL_PER_TOKEN"), described in config.json or in an older export's
    hf_quant_config.json: the same parameters once loaded, the same outputs."""
    src, ours, theirs = str(folders / "fp32"), str(tmp_path / "fp8"), str(tmp_path / "modelopt")
    write_fp8_checkpoint(src, ours, layout, static=static)
    write_fp8_checkpoint(src, theirs, f"mo-{layout}", static=static, legacy=legacy)
    fp8, modelopt = LLM(ours, **ENGINE), LLM(theirs, **ENGINE, quantization="modelopt")
    method = modelopt.engine.executor.model.model.layers[0].self_attn.qkv_proj.quant_method
    assert isinstance(method, Fp8LinearMethod) and isinstance(method, Fp8StaticLinearMethod) == static
    loaded = [llm.engine.executor.model.state_dict() for llm in (fp8, modelopt)]
    assert loaded[0].keys() == loaded[1].keys()
    assert all(torch.equal(loaded[0][name], loaded[1][name]) for name in loaded[0])
    assert prompt_logprobs(modelopt) == prompt_logprobs(fp8)


def test_moe_experts_with_static_activation_scales(tmp_path):
    """A static checkpoint of an MoE model (a calibrated input_scale for each expert's gate, up and down;
    AutoFP8's, compressed-tensors' and ModelOpt's layouts alike): each expert's inputs rounded with its
    own scales (gate/up: the larger), as transformers does with that rounding; TP=2 as TP=1."""
    src = str(tmp_path / "fp32")
    make_model_dir(src, **MOE)
    write_fp8_checkpoint(src, str(tmp_path / "static"), "tensor", static=True,
                         dequantized=str(tmp_path / "dequantized"))
    llm = LLM(str(tmp_path / "static"), **ENGINE)
    experts = llm.engine.executor.model.model.layers[0].mlp.experts
    assert experts.w13_input_scale.tolist() == pytest.approx([0.013 * (1 + e / 10) for e in range(8)])
    assert experts.w2_input_scale.tolist() == pytest.approx([0.020 * (1 + e / 10) for e in range(8)])
    lps, tokens = prompt_logprobs(llm)
    ref_lps, ref_tokens = w8a8_transformers(str(tmp_path / "dequantized"), None, static=True)
    assert max_error(lps, ref_lps) < TOL and tokens == ref_tokens
    # the dynamic checkpoint of the same weights rounds otherwise
    write_fp8_checkpoint(src, str(tmp_path / "dynamic"), "tensor")
    assert max_error(lps, prompt_logprobs(LLM(str(tmp_path / "dynamic"), **ENGINE))[0]) > 10 * TOL
    for layout in ("ct-tensor", "mo-tensor"):
        write_fp8_checkpoint(src, str(tmp_path / layout), layout, static=True)
    assert prompt_logprobs(LLM(str(tmp_path / "ct-tensor"), **ENGINE)) == (lps, tokens)
    excluded = ("lm_head", "model.layers.*.mlp.gate")  # ModelOpt leaves the routers out by name
    with open(tmp_path / "mo-tensor" / "config.json") as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] = list(excluded)
    with open(tmp_path / "mo-tensor" / "config.json", "w") as f:
        json.dump(config, f)
    assert prompt_logprobs(LLM(str(tmp_path / "mo-tensor"), **ENGINE)) == (lps, tokens)
    with LLM(str(tmp_path / "static"), **ENGINE, tensor_parallel_size=2) as tp2:
        lps2, tokens2 = prompt_logprobs(tp2)
    assert max_error(lps, lps2) < 1e-4 and tokens2 == tokens
    # every expert's scale must arrive: a missing one is named
    shutil.copytree(tmp_path / "static", tmp_path / "missing")
    tensors = load_file(tmp_path / "missing" / "model.safetensors")
    missing = "model.layers.2.mlp.experts.3.up_proj.input_scale"
    del tensors[missing]
    save_file(tensors, tmp_path / "missing" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lacks 1 tensors .*'{missing}'"):
        LLM(str(tmp_path / "missing"), **ENGINE)


def test_quantization_option_quantizes_per_channel_at_load(folders):
    llm = LLM(str(folders / "fp32"), **ENGINE, quantization="fp8")
    proj = llm.engine.executor.model.model.layers[1].mlp.gate_up_proj
    assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale.shape == (proj.weight.shape[0], 1)
    lps, _ = prompt_logprobs(llm)
    unquantized, _ = prompt_logprobs(LLM(str(folders / "fp32"), **ENGINE))
    # the weights' and activations' rounding (measured: mean 0.21, max 0.72 nats on this model)
    assert 0 < max_error(lps, unquantized) < 1.5


@pytest.mark.parametrize("layout", ["block", "ct-block"])
def test_tp2_shards_block_scales_as_tp1_holds_them(folders, tmp_path, layout):
    """16x16 blocks: the tiny model's per-rank q/k/v, gate/up and o/down widths (32, 16, 64, 32, 64) split
    into whole blocks at two ranks (in either checkpoint layout)."""
    write_fp8_checkpoint(str(folders / "fp32"), str(tmp_path / "b16"), layout, block=(16, 16))
    lps1, tokens1 = prompt_logprobs(LLM(str(tmp_path / "b16"), **ENGINE))
    with LLM(str(tmp_path / "b16"), **ENGINE, tensor_parallel_size=2) as tp2:
        lps2, tokens2 = prompt_logprobs(tp2)
    assert max_error(lps1, lps2) < 1e-4 and tokens1 == tokens2


def test_tp_size_that_splits_a_block_is_refused(folders):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 splits the fp8 checkpoint's weight-scale "
                                         r"blocks: \w+ holds (32|64) output rows per rank, not a multiple of "
                                         r"the block's 128"):
        LLM(str(folders / "block"), **ENGINE, tensor_parallel_size=2)


MOE = dict(arch="qwen3_moe", num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)


def test_moe_experts_from_a_block_checkpoint(tmp_path):
    src = str(tmp_path / "fp32")
    make_model_dir(src, **MOE)
    write_fp8_checkpoint(src, str(tmp_path / "block"), "block", block=(16, 16),
                         dequantized=str(tmp_path / "dequantized"))
    llm = LLM(str(tmp_path / "block"), **ENGINE)
    experts = llm.engine.executor.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w2_weight_scale.shape == (8, 64, 2)
    lps, _ = prompt_logprobs(llm)
    dequantized, _ = prompt_logprobs(LLM(str(tmp_path / "dequantized"), **ENGINE))
    # only the activations' rounding differs (measured: mean ~0.1, max ~0.5 nats on this model)
    assert 0 < max_error(lps, dequantized) < 1.0
    with LLM(str(tmp_path / "block"), **ENGINE, tensor_parallel_size=2) as tp2:
        lps2, _ = prompt_logprobs(tp2)
    assert max_error(lps, lps2) < 1e-4
    write_fp8_checkpoint(src, str(tmp_path / "ct-block"), "ct-block", block=(16, 16))
    assert prompt_logprobs(LLM(str(tmp_path / "ct-block"), **ENGINE))[0] == lps
    online, _ = prompt_logprobs(LLM(src, **ENGINE, quantization="fp8"))
    assert 0 < max_error(online, prompt_logprobs(LLM(src, **ENGINE))[0]) < 1.5
