"""Model runner: one per tensor-parallel rank. Builds the model on its device, loads the weights,
sizes and allocates the paged KV cache, and runs one scheduled step (rank 0 also samples)."""

import logging
import math

import torch
from torch import nn

from nanovllm.attention.backend import select_backend
from nanovllm.attention.metadata import forward_context
from nanovllm.config import Config
from nanovllm.engine.model_inputs import ModelInputs, prepare_decode, prepare_prefill, prepare_sampling
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler
from nanovllm.models import get_model_class
from nanovllm.utils.distributed import get_tp_rank
from nanovllm.utils.gguf_loader import gguf_weights
from nanovllm.utils.loader import init_dummy_weights, load_model, load_weights

logger = logging.getLogger("nanovllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: Config, rank: int = 0) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
        return torch.device("cuda", rank)
    return torch.device("cpu")


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    dtype = getattr(config.hf_config, "dtype", None) or getattr(config.hf_config, "torch_dtype", None)
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class ModelRunner:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.rank = get_tp_rank()
        self.device = resolve_device(config, self.rank)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.kvcache_block_size
        hf = config.hf_config
        self.vocab_size = hf.vocab_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model: nn.Module = get_model_class(hf)(hf)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, std=getattr(hf, "initializer_range", 0.02), seed=config.seed)
        elif config.load_format == "gguf":
            load_weights(self.model, gguf_weights(config.gguf_path, hf, self.dtype), config.gguf_path)
        else:
            load_model(self.model, config.model)
        self.model.eval()
        self.backend = select_backend(config.attention_backend, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self.num_kvcache_blocks = self._num_kvcache_blocks()
        self._allocate_kv_cache(self.num_kvcache_blocks)

    # ---- KV cache ----
    def _block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def _num_kvcache_blocks(self) -> int:
        config = self.config
        if config.num_kvcache_blocks is not None:
            return config.num_kvcache_blocks
        if self.device.type == "cuda":
            self._warmup()
            free, total = torch.cuda.mem_get_info(self.device)
            stats = torch.cuda.memory_stats(self.device)
            # Room for the KV cache: the allowed share of the GPU, minus what is in use now, minus the
            # activation peak the warm-up showed (it will recur during real steps).
            peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
            budget = total * config.gpu_memory_utilization - (total - free) - peak_extra
            source = f"gpu_memory_utilization={config.gpu_memory_utilization}"
        else:
            budget = config.cpu_kvcache_space_gib * 2**30
            source = f"cpu_kvcache_space_gib={config.cpu_kvcache_space_gib}"
        num_blocks = int(budget // self._block_bytes())
        if self.device.type == "cpu":  # never allocate more than the engine could ever use
            max_blocks = config.max_num_seqs * math.ceil(config.max_model_len / self.block_size)
            num_blocks = min(num_blocks, max_blocks)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache under {source}; raise it, or lower "
                             "max_num_batched_tokens / max_num_seqs")
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        layer = self.attention_layers[0]
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads,
                 layer.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One prefill at the largest batch the scheduler can form, so the activation peak is known."""
        config = self.config
        num_tokens = config.max_num_batched_tokens
        num_seqs = max(1, min(config.max_num_seqs, num_tokens // config.max_model_len))
        seq_len = min(config.max_model_len, num_tokens // num_seqs)
        seqs = [Sequence([0] * seq_len, block_size=self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = len(seq)
            seq.block_table = [0] * seq.num_blocks
        inputs = prepare_prefill(seqs, self.device)
        inputs.meta.slot_mapping.fill_(-1)  # there is no cache yet: store nothing
        self._forward(inputs, seqs)
        torch.cuda.synchronize(self.device)

    # ---- one step ----
    def _forward(self, inputs: ModelInputs, seqs: list[Sequence]) -> torch.Tensor | None:
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        if not inputs.sample_rows:
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if logits is None:  # not rank 0
            return None
        sampled = [seqs[row] for row in inputs.sample_rows]
        return self.sampler(logits, prepare_sampling(sampled, self.vocab_size, self.device))

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
        """Run one step; returns the new token of each sequence whose computation reached its end
        (None for sequences that only computed a chunk of their prompt, and on ranks other than 0)."""
        inputs = (prepare_prefill if is_prefill else prepare_decode)(seqs, self.device)
        tokens = self._forward(inputs, seqs)
        result: list[int | None] = [None] * len(seqs)
        if tokens is not None:
            for row, token in zip(inputs.sample_rows, tokens.tolist(), strict=True):
                result[row] = token
        return result
