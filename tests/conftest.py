"""Shared fixtures: tiny random models saved the way Hugging Face saves them, with a byte-level BPE
tokenizer trained locally, so tests need no network and no downloaded weights."""

import os

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A paged KV cache splits memory into fixed-size blocks shared between sequences.",
    "Continuous batching admits new requests while others are still decoding.",
    "0123456789 !?,.;:'\"()[]{}<>+-*/=_ hello world user assistant system",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Prompts of 1 to ~20 tokens for the end-to-end tests.
PROMPTS = [
    "Paris is the capital of",
    "The quick brown fox jumps over the lazy dog. A paged KV cache splits memory",
    "hello",
    "Continuous batching admits new requests while others are still decoding. 0123456789",
]

# Greedy tokens per prompt in the end-to-end comparisons with transformers.
MAX_TOKENS = 24

# Larger than transformers' default init (0.02), so that random logits are peaked and greedy
# decoding has clear winners instead of float-noise ties.
INIT_RANGE = 0.25


def make_tokenizer(path: str):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def make_model_dir(path: str, arch: str = "qwen3", tie: bool = False, shard: bool = False, **overrides):
    """Save a tiny random model + tokenizer in `path`; returns the transformers model (float32)."""
    import transformers

    tok = make_tokenizer(path)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=INIT_RANGE,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    common.update(overrides)
    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    if arch in ("qwen3", "llama", "qwen3_moe"):
        common.setdefault("head_dim", 16)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**common)).float().eval()
    with torch.no_grad():  # transformers zeroes biases; random ones show each lands where it belongs
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INIT_RANGE)
    model.save_pretrained(path, max_shard_size="100KB" if shard else "2GB")
    return model


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; two contend with the other processes on a small CI box.
    Modules that run many tiny forwards use it (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    make_model_dir(path)
    return path


@pytest.fixture(scope="session")
def hf_qwen3(qwen3_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(qwen3_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="session")
def reference(hf_qwen3, tokenizer):
    """transformers' greedy completions of PROMPTS (HF stops only at max_new_tokens: ignore_eos)."""
    hf_qwen3.generation_config.eos_token_id = None
    return [hf_greedy(hf_qwen3, tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (stops after EOS, like the engine)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


# Keep tests on the CPU, whatever the machine has; Triton kernels then run in Triton's interpreter
# (it must be chosen before triton is first imported).
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TRITON_INTERPRET", "1")


def _mend_interpreter() -> None:
    """Triton's interpreter (triton 3.9) keeps bfloat16 tensors as their raw uint16 bits, and handles them
    unlike the GPU in three places: its tl.dot multiplied those integers (every bf16 dot of a kernel run on
    the CPU came out as nonsense, so bf16 kernel tests could only compare two kernels' equal nonsense, or be
    skipped), it rounds float32 to bfloat16 toward zero where the GPU rounds to nearest even, and it casts
    an integer to bfloat16 as numpy casts it to uint16 (an int8 KV cache's tiles came out as tiny floats).
    Here bf16 dot operands are widened to float32 first (exact products, float32 sums, as tensor cores
    compute them; float16 ones too, so that a float16 dot sums in the very order a bf16 one does), the
    cast rounds to nearest even, and integers reach bfloat16 through float32.

    Its casts to e4m3 (tl.float8e4nv) drop the carry of a mantissa rounded up past 7: 7.8 became 4.0 and
    31.6 became 16.0 (2% of normal draws), where the GPU's cvt.rn.satfinite rounds to the nearest e4m3
    (8.0, 32.0) and saturates at 448. An fp8 KV cache stored by a Triton kernel on the CPU then differed
    from the reference backend's by up to 1.4 nats of prompt logprob. Here such casts go through torch's
    float8_e4m3fn conversion, which rounds and saturates as the GPU does; and e4m3's NaN, which it widened
    to 480, widens to NaN."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    create_dot, convert_float = builder.create_dot, interpreter._convert_float
    int_to_float = builder.create_si_to_fp

    def widen(handle):
        if handle.dtype.scalar == tl.float16:  # float32 too, laid out as bf16's: its sums run as theirs
            return interpreter.TensorHandle(np.ascontiguousarray(handle.data, dtype=np.float32), tl.float32)
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        widened = convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(widened, tl.float32)

    def create_widened_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def to_e4m3(data, input_dtype):
        wide = np.asarray(data)
        if input_dtype == tl.bfloat16:
            wide = convert_float(wide, tl.bfloat16, tl.float32, None).view(np.float32)
        e4m3 = torch.from_numpy(np.array(wide, dtype=np.float32)).to(torch.float8_e4m3fn)
        return e4m3.view(torch.uint8).numpy().reshape(wide.shape)

    def from_e4m3(data, output_dtype):
        wide = torch.from_numpy(np.array(data, dtype=np.uint8)).view(torch.float8_e4m3fn).float().numpy()
        if output_dtype == tl.bfloat16:  # kept as its bits: the upper half of float32's, exactly
            return (wide.view(np.uint32) >> 16).astype(np.uint16)
        return wide.astype(np.float16 if output_dtype == tl.float16 else np.float32)

    def convert_nearest(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16, tl.bfloat16):
            return to_e4m3(data, input_dtype)
        if input_dtype == tl.float8e4nv and output_dtype in (tl.float32, tl.float16, tl.bfloat16):
            return from_e4m3(data, output_dtype)
        if not (input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None):
            return convert_float(data, input_dtype, output_dtype, rounding_mode)
        bits = np.array(data, dtype=np.float32).view(np.uint32).astype(np.uint64)  # a copy, shape kept
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # ties to even
        return np.where(np.isnan(data), np.uint16(0x7FC0), rounded)

    def int_to_float_via_float32(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16:
            return int_to_float(self, src, dst_type)
        return self.cast_impl(int_to_float(self, src, tl.float32), dst_type)

    builder.create_dot = create_widened_dot
    builder.create_si_to_fp = int_to_float_via_float32
    interpreter._convert_float = convert_nearest


_mend_interpreter()

# Under pytest-xdist (README's test command: `-n auto`, a worker a core) each worker takes its share of
# the cores for torch's intra-op threads, so that the workers do not oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# With the GPU shown (CUDA_VISIBLE_DEVICES set), an engine sizes its KV cache to gpu_memory_utilization of
# the whole device: the first engine alive (a module-scoped one, or another xdist worker's) took 90% and
# every engine after it found no memory left. Tests' engines hold a few MB of KV; this caps each at
# GPU_TEST_KV_BYTES.
GPU_TEST_KV_BYTES = 1 << 30


@pytest.fixture(scope="session", autouse=True)
def gpu_kv_share():
    """Session-wide, so that module-scoped engines are capped too."""
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        yield
        return
    from nanovllm.runner import kv_cache

    whole = kv_cache.blocks_for_budget

    def share(config, device, bytes_per_block, activation_peak):
        num_blocks = whole(config, device, bytes_per_block, activation_peak)
        return min(num_blocks, GPU_TEST_KV_BYTES // bytes_per_block) if device.type == "cuda" else num_blocks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_cache, "blocks_for_budget", share)
        yield


def triton_test_device() -> str:
    """Where a kernel test module runs its tensors: the CPU under Triton's interpreter (the default
    above), else CUDA (`TRITON_INTERPRET=0` on a GPU machine); skips the module when neither works."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1" + (
            " (this conftest hides the GPU unless CUDA_VISIBLE_DEVICES is set, e.g. to 0)" if hidden else ""),
            allow_module_level=True)
    return "cuda"
