"""Model runner: one per tensor-parallel rank. Builds the model on its device, loads the weights,
sizes and allocates the paged KV cache, and runs one scheduled step (rank 0 also samples)."""

import logging
import math

import torch
from torch import nn

from nanovllm.attention.backend import select_backend
from nanovllm.attention.metadata import forward_context
from nanovllm.config import Config
from nanovllm.engine.cuda_graph import DecodeGraphs
from nanovllm.engine.model_inputs import ModelInputs, prepare_decode, prepare_prefill, prepare_sampling
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.layers.logits_processors import prepare_logits_processors
from nanovllm.layers.logprobs import prompt_logprobs, sampled_logprobs
from nanovllm.layers.sampler import Sampler
from nanovllm.models import get_model_class
from nanovllm.outputs import StepOutput
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams
from nanovllm.utils.distributed import get_tp_rank, min_across_ranks
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


def worst_case_sampling_batch(num_seqs: int, block_size: int) -> list[Sequence]:
    """Sequences whose sampling uses every option that costs memory, for the warm-up's peak."""
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                            frequency_penalty=0.1, logit_bias={0: 1.0}, allowed_token_ids=[0, 1],
                            logprobs=MAX_LOGPROBS)
    return [Sequence([0, 1], params, block_size) for _ in range(num_seqs)]


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
        logger.info("weights loaded (%s, %s on %s)", config.load_format, self.dtype, self.device)
        self.backend = select_backend(config.attention_backend, self.device, self.block_size, self.dtype)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphs | None = None
        self.num_kvcache_blocks = self._num_kvcache_blocks()
        self._allocate_kv_cache(self.num_kvcache_blocks)
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_decode_graphs()

    def _capture_decode_graphs(self) -> None:
        if not self.backend.supports_cuda_graph:
            logger.info("attention backend %s cannot run in CUDA graphs; decoding eagerly", self.backend.name)
            return
        config = self.config
        # The largest decode batch the scheduler can form: no step falls outside the captured sizes.
        max_batch = min(config.max_num_seqs, config.max_num_batched_tokens)
        max_blocks = math.ceil(config.max_model_len / self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, max_batch, max_blocks, config.hf_config.hidden_size,
                                          self.dtype, self.device)
        self.decode_graphs.capture()

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
            activation_peak = self._warmup()
            logger.info("warm-up forward done: %.2f GiB of activations at the largest batch",
                        activation_peak / 2**30)
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # Room for the KV cache: the allowed share of the GPU, minus what is in use now, minus the
            # activation peak the warm-up showed (it recurs during real steps).
            budget = total * config.gpu_memory_utilization - (total - free) - activation_peak
            source = f"gpu_memory_utilization={config.gpu_memory_utilization}"
        else:
            budget = config.cpu_kvcache_space_gib * 2**30
            source = f"cpu_kvcache_space_gib={config.cpu_kvcache_space_gib}"
        num_blocks = int(budget // self._block_bytes())
        if self.device.type == "cpu":  # never allocate more than the engine could ever use
            max_blocks = config.max_num_seqs * math.ceil(config.max_model_len / self.block_size)
            num_blocks = min(num_blocks, max_blocks)
        # One scheduler on rank 0 hands out block ids for every rank: all must hold as many blocks.
        num_blocks = min_across_ranks(num_blocks)
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

    def _release_kv_cache(self) -> None:
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        del self.kv_cache

    @torch.inference_mode()
    def _warmup(self) -> int:
        """One prefill at the largest batch the scheduler can form, over a temporary KV cache just big
        enough for it; returns the activation memory it took beyond that (bytes)."""
        config = self.config
        num_tokens = config.max_num_batched_tokens
        num_seqs = max(1, min(config.max_num_seqs, num_tokens // config.max_model_len))
        seq_len = min(config.max_model_len, num_tokens // num_seqs)
        seqs, next_block = [], 0
        for _ in range(num_seqs):
            seq = Sequence([0] * seq_len, block_size=self.block_size)
            seq.num_scheduled_tokens = seq_len
            seq.block_table = list(range(next_block, next_block + seq.num_blocks))
            next_block += seq.num_blocks
            seqs.append(seq)
        self._allocate_kv_cache(next_block)
        inputs = prepare_prefill(seqs, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._forward(inputs, seqs)
        # The largest decode batch samples from full-vocabulary logits (top-p sorts them, processors
        # and logprobs copy them): its peak too.
        max_batch = min(config.max_num_seqs, config.max_num_batched_tokens)
        hidden = torch.zeros(max_batch, config.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        self._sample(hidden, worst_case_sampling_batch(max_batch, self.block_size))
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        self._release_kv_cache()
        return activation_peak

    # ---- one step ----
    def _forward(self, inputs: ModelInputs, seqs: list[Sequence]) -> StepOutput:
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        prompt_lps = None
        if inputs.prompt_logprob_spans:  # every rank: the LM head gathers across ranks
            prompt_lps = prompt_logprobs(self.model.compute_logits, hidden, inputs.prompt_logprob_spans, seqs)
        out = self._sample(hidden[inputs.logits_indices], [seqs[row] for row in inputs.sample_rows])
        out.prompt_logprobs = prompt_lps
        return out

    def _sample(self, hidden: torch.Tensor, seqs: list[Sequence]) -> StepOutput:
        """Sample the rows of `hidden` (one per seq); tokens and logprobs are indexed like seqs."""
        if not seqs:
            return StepOutput([])
        logits = self.model.compute_logits(hidden)
        if logits is None:  # not rank 0
            return StepOutput([None] * len(seqs))
        raw = logits
        processors = prepare_logits_processors(seqs, self.vocab_size, self.device)
        if processors is not None:
            logits = processors.apply(logits)
        tokens = self.sampler(logits, prepare_sampling(seqs, self.vocab_size, self.device))
        ks = [seq.sampling_params.logprobs for seq in seqs]
        # Raw-model logprobs (vLLM's default logprobs_mode), only when some row asked.
        logprobs = sampled_logprobs(raw, tokens, ks) if any(k is not None for k in ks) else None
        return StepOutput(tokens.tolist(), logprobs)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> StepOutput:
        """Run one step; returns, per sequence, the new token of each whose computation reached its end
        (None for sequences that only computed a chunk of their prompt, and on ranks other than 0),
        with the logprobs and prompt logprobs that sequences asked for."""
        if not is_prefill and self.decode_graphs and self.decode_graphs.can_run(len(seqs)):
            out = self._sample(self.decode_graphs.run(seqs), seqs)
            sample_rows = range(len(seqs))
        else:
            inputs = (prepare_prefill if is_prefill else prepare_decode)(seqs, self.device)
            out, sample_rows = self._forward(inputs, seqs), inputs.sample_rows
        # Sampled rows -> batch rows.
        token_ids: list[int | None] = [None] * len(seqs)
        logprobs = None if out.logprobs is None else [None] * len(seqs)
        for i, row in enumerate(sample_rows):
            token_ids[row] = out.token_ids[i]
            if logprobs is not None:
                logprobs[row] = out.logprobs[i]
        return StepOutput(token_ids, logprobs, out.prompt_logprobs)
