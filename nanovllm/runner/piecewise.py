"""CUDA graphs for prefill and mixed steps, in pieces around attention. A mixed step's token count
changes every step and its attention depends on the step's metadata (how many sequences, which
blocks), so the whole forward cannot be one graph; but everything between two attention calls (the
output projection, MLP and norms of layer i, then layer i+1's norm and QKV projection) depends on the
token count alone. Those pieces are captured once per size of a token ladder and replayed; the
attention runs eagerly in between. Launched eagerly, a mixed step's ~300 kernels took 16-30 ms of
host time against ~15 ms of GPU time; with the pieces, 8 ms (docs/performance-notes.md, section
"CUDA graphs"; commit 7e1bfc0, 2026-11-30).

Piece 0 is the embedding and layer 0's attention_input, piece i (1 <= i < L) layer i-1's
attention_output and layer i's attention_input, piece L layer L-1's attention_output and the final norm
(models/decoder.py's DecoderLayer). Pieces pass values through
static buffers sized for the largest captured step: every size's graphs address the same buffers,
and the pool of each size's intermediates is shared (captures and replays never overlap)."""

import logging

import torch
from torch import nn

from nanovllm.layers.parallel import get_tp_group
from nanovllm.runner.inputs import ModelInputs, padded_num_tokens

logger = logging.getLogger("nanovllm")

# Above this many tokens a step's GPU work (an estimated 2.5 ms per 1,000 tokens for Qwen3-0.6B's linears
# on an H200: 20 ms here) is as long as its eager launch, and more sizes would cost start-up time and
# graph memory for little.
MAX_GRAPH_TOKENS = 8192
# The graphs' memory (the static buffers and the largest piece's intermediates) is held for the engine's
# life and counted before the KV cache is sized: the ladder stops where its estimate passes this share
# of the GPU's memory. By token_bytes' estimate Qwen3-0.6B needs 53 KB a token (0.4 GB at 8,192 tokens,
# 0.3% of an H200); Qwen3-8B 164 KB, so a 24 GB card stops its ladder near 4,700 tokens instead of
# giving the graphs 1.3 GB of its KV cache.
MAX_MEMORY_SHARE = 0.03
# Below this the ladder is padded_num_tokens' (powers of two, then multiples of 64); above it, eight
# sizes per doubling keep the padding under 1/8 of a step's tokens.
FINE_LADDER_LIMIT = 512
SIZES_PER_DOUBLING = 8


def graph_token_sizes(max_num_tokens: int) -> list[int]:
    """The captured token counts: every padded_num_tokens value up to FINE_LADDER_LIMIT, then eight a
    doubling (multiples of 64), up to min(max_num_tokens, MAX_GRAPH_TOKENS) rounded up to a size."""
    limit = min(max_num_tokens, MAX_GRAPH_TOKENS)
    sizes, n = set(), 1
    while True:
        size = padded_num_tokens(n)
        if size > FINE_LADDER_LIMIT:
            low = 1 << (size - 1).bit_length() - 1  # the doubling the size falls in: (low, 2 * low]
            step = max(64, low // SIZES_PER_DOUBLING)
            size = -(-size // step) * step
        sizes.add(size)
        if size >= limit:
            return sorted(sizes)
        n = size + 1


def token_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Estimated bytes a token takes in the static buffers and, at most, in one piece's intermediates
    (norm outputs, the residual sum, the projections, the MLP's or the experts' activations)."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    hidden = layer.input_layernorm.weight.shape[0]
    qkv, attn_out = attn.qkv_proj.weight.shape[0], attn.num_heads * attn.head_dim
    if hasattr(mlp, "gate_up_proj"):  # gate and up, then their SiLU-mul product
        activations = mlp.gate_up_proj.weight.shape[0] * 3 // 2
    else:  # MoE: each of top_k experts' gate, up and product per token
        activations = mlp.top_k * mlp.experts.w13_weight.shape[1] * 3 // 2
    buffers = qkv + attn_out + 2 * hidden
    piece = 5 * hidden + qkv + activations
    return (buffers + piece) * torch.empty((), dtype=dtype).element_size() + 8  # + the int64 token id


def memory_token_limit(model: nn.Module, dtype: torch.dtype, total_memory: int) -> int:
    """The most tokens a captured size may have on a GPU of total_memory bytes (MAX_MEMORY_SHARE)."""
    return int(total_memory * MAX_MEMORY_SHARE) // token_bytes(model, dtype)


class PiecewiseGraphs:
    def __init__(self, model: nn.Module, max_num_tokens: int, dtype: torch.dtype, device: torch.device,
                 use_cuda_graph: bool = True, sizes: list[int] | None = None) -> None:
        """model: a DecoderForCausalLM (models/decoder.py). use_cuda_graph=False runs the same pieces
        through the same buffers eagerly (tests on the CPU)."""
        decoder = model.model
        self.embed, self.layers, self.norm = decoder.embed_tokens, list(decoder.layers), decoder.norm
        self.sizes = sizes or graph_token_sizes(max_num_tokens)
        self.max_num_tokens = t = self.sizes[-1]
        attn = self.layers[0].self_attn
        qkv_width = attn.qkv_proj.weight.shape[0]  # this rank's q, k and v columns
        hidden_size = self.norm.weight.shape[0]
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.qkv = torch.zeros(t, qkv_width, dtype=dtype, device=device)
        self.residual = torch.zeros(t, hidden_size, dtype=dtype, device=device)
        self.attn_out = torch.zeros(t, attn.num_heads * attn.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, hidden_size, dtype=dtype, device=device)
        self.use_cuda_graph = use_cuda_graph
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured size a step of num_tokens runs at, or None when it is too large for any."""
        if num_tokens > self.max_num_tokens or (self.use_cuda_graph and not self.graphs):
            return None
        return next(size for size in self.sizes if size >= num_tokens)

    def _piece(self, i: int, n: int) -> None:
        """Piece i on the first n rows of the buffers."""
        if i == 0:
            hidden, residual = self.embed(self.input_ids[:n]), None
        else:
            hidden, residual = self.layers[i - 1].attention_output(self.attn_out[:n], self.residual[:n])
        if i < len(self.layers):
            qkv, residual = self.layers[i].attention_input(hidden, residual)
            self.qkv[:n].copy_(qkv)
            self.residual[:n].copy_(residual)
        else:
            self.hidden[:n].copy_(self.norm(hidden, residual)[0])

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, so the smaller sizes' pieces reuse its memory pool."""
        for n in reversed(self.sizes):
            for i in range(len(self.layers) + 1):
                self._piece(i, n)  # warm-up: compiles, autotunes and picks GEMMs outside the capture
            pieces = []
            for i in range(len(self.layers) + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, self.pool):
                    self._piece(i, n)
                if self.pool is None:
                    self.pool = graph.pool()
                pieces.append(graph)
            self.graphs[n] = pieces
        torch.cuda.synchronize()
        group = get_tp_group()
        if group is not None and group.world_size > 1:  # the graphs hold the group's collectives
            group.before_destroy(self.release)
        logger.debug("captured %d x %d piecewise CUDA graphs for steps of up to %d tokens",
                     len(self.graphs), len(self.layers) + 1, self.max_num_tokens)

    def release(self) -> None:
        """Free the graphs and their memory pool; steps run eagerly from then on. Idempotent."""
        if self.graphs:
            torch.cuda.synchronize()  # no replay may still be running on the GPU
            self.graphs.clear()
            self.pool = None

    def _run_piece(self, i: int, n: int) -> None:
        if self.use_cuda_graph:
            self.graphs[n][i].replay()
        else:
            self._piece(i, n)

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """The final hidden states [n, hidden] of a step whose inputs are padded to a captured size n
        (model_inputs(..., num_padded=padded_size(...)))."""
        n = inputs.input_ids.shape[0]
        assert n in self.sizes, f"inputs of {n} tokens are not padded to a captured size"
        self.input_ids[:n].copy_(inputs.input_ids)
        for i, layer in enumerate(self.layers):
            self._run_piece(i, n)
            self.attn_out[:n].copy_(layer.self_attn.attn(self.qkv[:n], inputs.positions, inputs.meta))
        self._run_piece(len(self.layers), n)
        return self.hidden[:n]
