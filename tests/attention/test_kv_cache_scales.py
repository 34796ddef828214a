"""Calibrated KV-cache scales from the checkpoint (utils/kv_scales.py): an fp8 cache stores k / k_scale
and v / v_scale with each layer's scales, so a model whose keys and values pass e4m3's range (448) keeps
the full-precision cache's outputs as closely as one whose keys stay small; other caches leave the
scales unread; every name layout vLLM reads gives the same outputs; TP=2 ranks each take them.

The model: the tiny Qwen3 with its keys and values made BIG times larger (k_norm and v_proj weights times
BIG, q_norm and o_proj weights over BIG), the same function of its inputs; scales calibrated with
transformers on the prompts (largest key and value of each layer / 448)."""

import json
import os
import shutil

import pytest
import torch
from conftest import PROMPTS, make_model_dir, triton_test_device
from fp8_files import compressed_tensors_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.llm import prompt_logits

pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = dict(kvcache_block_size=4, max_model_len=128, max_num_seqs=16, device="cpu", dtype="float32")
BIG = 1024.0  # keys reach ~3,000 and values ~8,000: far past e4m3's 448 with a unit scale
FP8_MAX = 448.0


def calibrate(folder: str, ids: list[list[int]]) -> dict[tuple[int, str], float]:
    """{(layer, "k" / "v"): scale} over the prompts: a key's rotated pair never exceeds its norm, so the
    largest pair norm after k_norm bounds the cached keys."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    amax: dict[tuple[int, str], float] = {}

    def hook(layer: int, which: str):
        def record(module, inputs, out):
            if which == "k":
                half = out.shape[-1] // 2
                out = (out[..., :half] ** 2 + out[..., half:] ** 2).sqrt()
            amax[layer, which] = max(amax.get((layer, which), 0.0), out.abs().amax().item())
        return record

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_norm.register_forward_hook(hook(i, "k"))
        layer.self_attn.v_proj.register_forward_hook(hook(i, "v"))
    with torch.no_grad():
        for x in ids:
            model(torch.tensor([x]))
    return {key: value / FP8_MAX for key, value in amax.items()}


def write(src: str, dst: str, tensors: dict, quantization_config: dict | None = None) -> None:
    shutil.copytree(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**config, "quantization_config": quantization_config}, f)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """"big" (no scales), "ct" (llm-compressor's KV-cache-only layout: a kv_cache_scheme, no config
    groups, `self_attn.k_scale`), "output-scale" (the same scales as `k_proj.output_scale`), and the
    calibration and prompts."""
    root = tmp_path_factory.mktemp("kv-scales")
    src = str(root / "src")
    make_model_dir(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in tensors:
        if name.endswith(("k_norm.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * BIG
        elif name.endswith(("q_norm.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / BIG
    write(src, str(root / "big"), tensors)
    tok = AutoTokenizer.from_pretrained(src)
    prompts = [tok.encode(p) + [5, 6, 7] for p in PROMPTS]  # a few tokens read back from the cache
    scales = calibrate(str(root / "big"), prompts)
    own = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(s) for (i, w), s in scales.items()}
    write(src, str(root / "ct"), {**tensors, **own}, compressed_tensors_config(None, kv_cache=True))
    output = {f"model.layers.{i}.self_attn.{w}_proj.output_scale": torch.tensor([s])
              for (i, w), s in scales.items()}
    write(src, str(root / "output-scale"), {**tensors, **output})
    return root, scales, prompts


def relative_errors(llm: LLM, reference: LLM, prompts: list[list[int]]) -> list[float]:
    errors = []
    for x in prompts:
        expected = prompt_logits(reference, x)
        errors.append(((prompt_logits(llm, x) - expected).norm() / expected.norm()).item())
    return errors


def test_an_fp8_cache_with_the_checkpoints_scales_stays_close_where_values_pass_e4m3s_range(folders):
    root, _, prompts = folders
    full = LLM(str(root / "big"), **OPTIONS)
    scaled = LLM(str(root / "ct"), kv_cache_dtype="fp8", **OPTIONS)
    unit = LLM(str(root / "big"), kv_cache_dtype="fp8", **OPTIONS)
    # As tests/attention/test_kv_cache_fp8.py's small keys: e4m3's 3-bit mantissa, a few percent.
    assert max(relative_errors(scaled, full, prompts)) < 0.15
    # Unit scales clamp the keys and values at 448: the outputs are lost.
    assert min(relative_errors(unit, full, prompts)) > 0.5


def test_only_an_fp8_cache_takes_the_scales_and_every_layer_its_own(folders):
    root, scales, prompts = folders
    fp8 = LLM(str(root / "ct"), kv_cache_dtype="fp8", **OPTIONS)
    layers = fp8.engine.executor.attention_layers
    expected = [(torch.tensor(scales[i, "k"]).item(), torch.tensor(scales[i, "v"]).item())
                for i in range(len(layers))]
    assert [(layer.k_scale, layer.v_scale) for layer in layers] == expected
    assert len(set(expected)) == len(layers)  # each layer's own, not one for all
    for dtype in ("auto", "int8"):
        llm = LLM(str(root / "ct"), kv_cache_dtype=dtype, **OPTIONS)
        assert all(layer.k_scale == layer.v_scale == 1.0 for layer in llm.engine.executor.attention_layers)
    exact, plain = LLM(str(root / "ct"), **OPTIONS), LLM(str(root / "big"), **OPTIONS)
    assert torch.equal(prompt_logits(exact, prompts[0]), prompt_logits(plain, prompts[0]))


def test_compressed_tensors_and_output_scale_names_give_the_same_outputs(folders):
    root, _, prompts = folders
    ct = LLM(str(root / "ct"), kv_cache_dtype="fp8", **OPTIONS)
    older = LLM(str(root / "output-scale"), kv_cache_dtype="fp8", **OPTIONS)
    for x in prompts:
        assert torch.equal(prompt_logits(ct, x), prompt_logits(older, x))


def test_every_tensor_parallel_rank_takes_the_scales(folders):
    """Each of two ranks holds one KV head: a rank left with unit scales would clamp its keys and values."""
    root, _, prompts = folders
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)

    def outputs(llm: LLM) -> tuple[list[list[float]], list[list[int]]]:
        outs = llm.generate([{"prompt_token_ids": x} for x in prompts], params, use_tqdm=False)
        logprobs = [[o["prompt_logprobs"][i][t] for i, t in enumerate(o["prompt_token_ids"]) if i]
                    for o in outs]
        return logprobs, [o["token_ids"] for o in outs]

    one = outputs(LLM(str(root / "ct"), kv_cache_dtype="fp8", **OPTIONS))
    with LLM(str(root / "ct"), kv_cache_dtype="fp8", tensor_parallel_size=2, **OPTIONS) as llm:
        two = outputs(llm)
    assert two[1] == one[1]
    torch.testing.assert_close(torch.tensor(sum(two[0], [])), torch.tensor(sum(one[0], [])),
                               rtol=0, atol=1e-4)


def test_the_triton_backend_applies_the_scales_as_the_torch_backend(folders):
    """The Triton kernels (interpreted on CPU; on a GPU with TRITON_INTERPRET=0) store and read the fp8
    cache with the layers' scales as the reference backend does: the same greedy tokens, and prompt
    logprobs to float32 rounding (the same e4m3 values stored: tests/conftest.py mends the interpreter's
    e4m3 rounding)."""
    triton_test_device()  # skips where Triton can run neither interpreted nor on a GPU
    root, _, prompts = folders
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    # Both on one device (the GPU where there is one: there the model's float32 GEMMs sum in other orders
    # than the CPU's, and keys this large cross e4m3 rounding boundaries), with a fixed cache (on a GPU it
    # would otherwise take most of the free memory).
    on_device = {**OPTIONS, "device": "auto", "enforce_eager": True, "num_kvcache_blocks": 256}
    requests = [{"prompt_token_ids": x} for x in prompts]
    outs = [LLM(str(root / "ct"), kv_cache_dtype="fp8", attention_backend=backend, **on_device).generate(
        requests, params, use_tqdm=False) for backend in ("torch", "triton")]
    assert [o["token_ids"] for o in outs[1]] == [o["token_ids"] for o in outs[0]]
    for got, want in zip(*outs, strict=True):
        lps = [[entry[t] for entry, t in zip(o["prompt_logprobs"][1:], o["prompt_token_ids"][1:])]
               for o in (got, want)]
        torch.testing.assert_close(torch.tensor(lps[0]), torch.tensor(lps[1]), atol=1e-3, rtol=0)
