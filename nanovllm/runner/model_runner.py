"""Model runner: one per tensor-parallel rank. Builds the model on its device, loads the weights,
sizes and allocates the paged KV cache, captures the decode CUDA graphs, and runs one step from its
StepBatch record (rank 0 also samples). Decode steps replay whole-model CUDA graphs (cuda_graph.py),
prefill and mixed steps up to a few thousand tokens piecewise ones around attention (piecewise.py)."""

import gc
import logging
import math
import time
from dataclasses import dataclass

import torch

from nanovllm.attention.layer import Attention
from nanovllm.attention.registry import select_backend
from nanovllm.config import Config
from nanovllm.engine.executor import ExecutorInfo
from nanovllm.engine.step import SamplingBatch, StepBatch, StepOutput
from nanovllm.layers.kernel_plan import KernelPlan, kernel_table
from nanovllm.layers.parallel import get_tp_rank
from nanovllm.layers.sampler import SamplingTensors
from nanovllm.runner import kv_cache, warm_up
from nanovllm.runner.cuda_graph import DecodeGraphs, staging_bytes
from nanovllm.runner.inputs import model_inputs, padded_num_tokens, to_device
from nanovllm.runner.model_loading import build_model
from nanovllm.runner.piecewise import PiecewiseGraphs, memory_token_limit
from nanovllm.runner.sampling import StepSampler, prompt_logprobs_by_row
from nanovllm.runner.transfers import DeferredOutput, PendingOutput, Uploads
from nanovllm.runner.verify_graphs import capture_decode_graphs, route
from nanovllm.utils.cpu_threads import CpuThreadPolicy

logger = logging.getLogger("nanovllm")


# Upload bytes a sampling row can take: temperature, top-k, top-p, min-p, seed (runner/inputs.py), and
# room for the reservations' alignment (transfers.ALIGN) besides.
SAMPLING_BYTES_PER_ROW = 4 + 8 + 4 + 4 + 8
UPLOAD_SLACK = 1024


@dataclass(slots=True)
class Forward:
    """A step's forward pass as the sampler meets it."""

    hidden: torch.Tensor  # the sampling rows' last tokens' hidden states [len(batch.sample_rows), hidden]
    all_hidden: torch.Tensor | None  # every token's [num_tokens, hidden] (None from a CUDA graph)
    logits: torch.Tensor | None  # the sampling rows' logits where a decode graph computed them
    params: SamplingTensors | None  # the sampler's tensors (None where this rank or the graph samples)
    sampled: torch.Tensor | None = None  # the tokens a decode graph sampled itself
    sampled_host: torch.Tensor | None = None  # pinned memory for their copy to the host


def runner_device(config: Config, rank: int) -> torch.device:
    """Rank r of a CUDA engine runs on GPU r; every rank of a CPU engine on the CPU."""
    return torch.device("cuda", rank) if config.device_type == "cuda" else torch.device("cpu")


class ModelRunner:
    """One rank's device side; with one rank, the engine's Executor (nanovllm.engine.executor)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rank = get_tp_rank()
        self.world_size = config.tensor_parallel_size
        self.device = runner_device(config, self.rank)
        self.dtype: torch.dtype = getattr(torch, config.model_dtype)
        self.kv_dtype: torch.dtype = getattr(torch, config.cache_dtype)  # the model's, or fp8
        self.block_size = config.kvcache_block_size
        hf = config.hf_config
        self.vocab_size = hf.vocab_size
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.set_device(self.device)
        # Tensor-parallel ranks share the cores out evenly instead (nanovllm.distributed.worker).
        self.cpu_threads: CpuThreadPolicy | None = None
        if self.device.type == "cpu" and config.tensor_parallel_size == 1:
            self.cpu_threads = CpuThreadPolicy(config.cpu_threads)
            self.cpu_threads.apply()
        torch.manual_seed(config.seed)
        plan = KernelPlan.for_device(self.device, self.dtype, config.skinny_gemm,
                                     quantization=config.quantization, hf_config=hf)
        self.model = build_model(config, plan, self.device, self.dtype, self.kv_dtype)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        layer = self.attention_layers[0]
        self.backend = select_backend(config.attention_backend, self.device, self.block_size, self.dtype,
                                      config.max_num_seqs, layer.num_kv_heads, self.kv_dtype)
        for layer in self.attention_layers:
            layer.backend = self.backend
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kernels by rows:\n%s", kernel_table(self.model, self.backend))
        self.sampler = StepSampler(self.vocab_size, self.device, compiled=on_gpu and config.torch_compile)
        self.pad_eager = on_gpu
        # Each step's small inputs in one copy off the compute stream, its sampled ids back on another
        # (runner/transfers.py).
        max_batch, max_blocks = self._decode_graph_size()
        self.uploads = Uploads(self.device, staging_bytes(max_batch, max_blocks)
                               + SAMPLING_BYTES_PER_ROW * config.max_num_seqs + UPLOAD_SLACK)
        self.download_stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculative verification (runner/verify_graphs.py)
        self.piecewise: PiecewiseGraphs | None = None
        if on_gpu and not config.enforce_eager:
            # Before the KV cache is sized: the graphs' buffers and memory pool then count as in use.
            limit = min(config.max_num_batched_tokens,
                        memory_token_limit(self.model, self.dtype,
                                           torch.cuda.get_device_properties(self.device).total_memory))
            self.piecewise = PiecewiseGraphs(self.model, limit, self.dtype, self.device)
            self.piecewise.capture()
        self.num_kvcache_blocks = self._num_kvcache_blocks()
        self._allocate_kv_cache(self.num_kvcache_blocks)
        if on_gpu and not config.enforce_eager:
            self._capture_decode_graphs()
        if on_gpu:  # what a step would otherwise meet first mid-run (runner/warm_up.py)
            self.backend.warm_up(self.attention_layers[0], self.dtype, config.max_num_seqs,
                                 math.ceil(config.max_model_len / self.block_size))
            warm_up.gemm_shapes(self.model, config, self.dtype, self.device)
            if config.torch_compile or self.sampler.sampler.fused_race:
                warm_up.sampler(self.model, self.sampler, config.hf_config.hidden_size, self.dtype,
                                self.device)
        threads = self.cpu_threads.num_threads if self.cpu_threads is not None else None
        self.info = ExecutorInfo(str(self.device), config.model_dtype, self.backend.name,
                                 self.num_kvcache_blocks, threads)

    def _decode_graph_size(self) -> tuple[int, int]:
        """(the largest decode batch the scheduler can form, so that no step falls outside the captured
        sizes; the most blocks a sequence can hold)."""
        config = self.config
        return (min(config.max_num_seqs, config.max_num_batched_tokens),
                math.ceil(config.max_model_len / self.block_size))

    def _capture_decode_graphs(self) -> None:
        if not self.backend.supports_cuda_graph:
            logger.info("attention backend %s cannot run in CUDA graphs; decoding eagerly", self.backend.name)
            return
        max_batch, max_blocks = self._decode_graph_size()
        self.decode_graphs, self.verify_graphs = capture_decode_graphs(
            self.model, self.config, max_batch, max_blocks, self.dtype, self.device,
            self.sampler.graph_race())

    # ---- KV cache ----
    def _num_kvcache_blocks(self) -> int:
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        return kv_cache.num_blocks_that_fit(self)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = kv_cache.allocate(self.attention_layers, num_blocks, self.block_size, self.kv_dtype,
                                          self.device)

    def _release_kv_cache(self) -> None:
        kv_cache.detach(self.attention_layers)
        del self.kv_cache

    # ---- one step ----
    def _previous_tokens(self, batch: StepBatch, prev_sampled: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(indices into the step's input ids, the tokens to put there) for the inputs the previous step
        sampled (overlap scheduling): gathered on the device, never read on the host."""
        if not batch.prev_token_indices:
            return None
        assert prev_sampled is not None, "the batch takes tokens from a previous step but got none"
        rows = to_device(batch.prev_token_rows, torch.int64, self.device)
        return to_device(batch.prev_token_indices, torch.int64, self.device), prev_sampled[rows]

    def _forward(self, batch: StepBatch, prev_sampled: torch.Tensor | None = None) -> Forward:
        """Queue the step's forward pass (and, in a small decode graph, the sampling of rows that ask for
        no more than a temperature and a seed); prev_sampled: the previous step's sampled ids."""
        threads = self.cpu_threads
        if threads is not None and (time.monotonic() >= threads.next_look
                                    or torch.get_num_threads() != threads.num_threads):
            threads.apply()
        uploads, graphs = self.uploads, self.decode_graphs
        if batch.spec_token_ids and self.verify_graphs is not None:  # verification as decode rows
            batch, graphs = route(batch, graphs, self.verify_graphs)
        uploads.begin()
        staged = None
        if not batch.is_prefill and graphs and graphs.can_run(batch.num_seqs):
            race_rows = None
            if batch.sampling is not None and graphs.samples(batch.num_seqs):
                race_rows = self.sampler.race_rows(batch.sampling)
            staged = graphs.stage(batch, uploads, race_rows)
        params = None
        if batch.sampling is not None and batch.sample_rows and (staged is None or staged.out_start is None):
            params = self.sampler.tensors(batch.sampling, uploads.put)
        uploads.flush()
        if staged is not None:  # decode: every row samples
            out = graphs.replay(staged, prev_sampled)
            return Forward(out.hidden, None, out.logits, params, out.sampled, out.sampled_host)
        prev_tokens = self._previous_tokens(batch, prev_sampled)
        # Prefill and mixed steps run padded to a size the piecewise graphs were captured at, or when
        # too large for them, eagerly, padded so that cuBLAS meets only shapes it has seen (inputs.py).
        graph_size = num_padded = None
        if batch.is_prefill:
            num_tokens = len(batch.input_ids)
            graph_size = self.piecewise.padded_size(num_tokens) if self.piecewise else None
            num_padded = graph_size or (padded_num_tokens(num_tokens) if self.pad_eager else None)
        inputs = model_inputs(batch, self.device, num_padded)
        if prev_tokens is not None:
            inputs.input_ids[prev_tokens[0]] = prev_tokens[1]
        if graph_size:
            hidden = self.piecewise.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return Forward(hidden[inputs.logits_indices], hidden, None, params)

    def _sampling_logits(self, hidden: torch.Tensor, logits: torch.Tensor | None, batch: StepBatch
                         ) -> torch.Tensor | None:
        """The sampling rows' logits: `logits` where the step's graph computed them."""
        if not batch.sample_rows:
            return hidden.new_empty(0, self.vocab_size) if self.rank == 0 else None
        return logits if logits is not None else self.model.compute_logits(hidden)

    @torch.inference_mode()
    def logits(self, batch: StepBatch, previous: PendingOutput | DeferredOutput | None = None):
        """Run the step's forward pass (previous: as launch's); the sampling rows' logits [rows, vocab] on
        rank 0, None on the other ranks (every rank must call it: the LM head gathers across them)."""
        forward = self._forward(batch, previous.sampled if previous is not None else None)
        return self._sampling_logits(forward.hidden, forward.logits, batch)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> StepOutput | None:
        """Run one step; returns on rank 0 the new token of each sampling row (batch.sample_rows order)
        with the logprobs and prompt logprobs its sequences asked for; None on the other ranks."""
        pending = self.launch(batch)
        return None if pending is None else pending.wait()

    @torch.inference_mode()
    def launch(self, batch: StepBatch, previous: PendingOutput | DeferredOutput | None = None,
               defer_sampling: bool = False) -> PendingOutput | DeferredOutput | None:
        """Start one step without waiting for it: forward, sampling and the copy of the sampled ids to
        the host are queued on the device; `wait()` on the result reads them (None on the other ranks).
        previous: the step launched before, whose sampled ids feed the batch's prev_token_* inputs.
        defer_sampling: sample at the result's `sample()` (Executor.launch)."""
        forward = self._forward(batch, previous.sampled if previous is not None else None)
        if forward.sampled is not None:  # a decode graph's own race (no logprobs asked)
            return PendingOutput(forward.sampled, None, None, self.download_stream, forward.sampled_host)
        prompt_lps = None
        if batch.prompt_logprob_spans:  # every rank: the LM head gathers across ranks
            assert forward.all_hidden is not None, "prompt logprobs come from prefill steps: no graph"
            prompt_lps = prompt_logprobs_by_row(self.model.compute_logits, forward.all_hidden,
                                                batch.prompt_logprob_spans)
        logits = self._sampling_logits(forward.hidden, forward.logits, batch)
        if logits is None:
            return None
        if batch.sample_rows and defer_sampling:
            return DeferredOutput(lambda: self._sample(logits, batch, forward.params, prompt_lps))
        if batch.sample_rows:
            tokens, logprobs = self.sampler.sample(logits, batch.sampling, forward.params)
        else:
            tokens, logprobs = torch.empty(0, dtype=torch.int64, device=self.device), None
        return PendingOutput(tokens, logprobs, prompt_lps, self.download_stream)

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, batch: StepBatch, params: SamplingTensors | None,
                prompt_lps: dict | None) -> PendingOutput:
        tokens, logprobs = self.sampler.sample(logits, batch.sampling, params)
        return PendingOutput(tokens, logprobs, prompt_lps, self.download_stream)

    def check_sampling(self, sampling: SamplingBatch) -> None:
        """Raise what rank 0 would raise turning these sampling rows into tensors (on the CPU)."""
        self.sampler.check(sampling)

    def shutdown(self) -> None:
        """Free the model and its KV cache now (the layers' weight loaders form reference cycles).
        Idempotent."""
        if not hasattr(self, "model"):
            return
        for graphs in (self.decode_graphs, self.verify_graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        # The graph runners hold the model's modules, and the attention layers views of the cache:
        # while this runner lives (an LLM object not yet collected), none may keep the cache alive.
        self.decode_graphs = self.verify_graphs = self.piecewise = None
        self.uploads.release()
        kv_cache.detach(self.attention_layers)
        del self.model, self.attention_layers
        self.kv_cache = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the memory back, e.g. to the next engine in this process
