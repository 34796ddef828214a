"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary
(the last slice padded when the vocabulary does not divide evenly). The LM head's matmul is its linear
method's (layers/linear_methods.py); its weight stays the embedding's (dense, and tied to it where the
checkpoint ties them)."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear_methods import LinearMethod, UnquantizedLinearMethod
from nanovllm.layers.parallel import all_reduce, gather_to_rank0, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.num_per_partition * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.num_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expected = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded.shape) != expected:  # slicing would silently take a short or long vocabulary
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit the vocabulary "
                             f"{expected}")
        shard = loaded[self.vocab_start:self.vocab_start + self.num_per_partition]
        param.data[:shard.shape[0]].copy_(shard)
        param.data[shard.shape[0]:].zero_()

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[int | str | None, tuple[int, ...]]:
        """See LinearBase.checkpoint_shapes: the whole vocabulary, without the padding."""
        return {None: (self.num_embeddings, *param.shape[1:])}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_per_partition)
        y = F.embedding(local.clamp(0, self.num_per_partition - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[num_tokens, hidden] -> [num_tokens, vocab] on rank 0 (None on other ranks)."""
        logits = self.quant_method.apply(self, hidden_states, None)
        if self.tp_size > 1:
            logits = gather_to_rank0(logits, dim=-1)
            if logits is None:
                return None
        return logits[:, :self.num_embeddings]
