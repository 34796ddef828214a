"""The small decode graphs' own sampler (runner/cuda_graph.py, `race`): a step whose rows ask for nothing
but a temperature and a seed takes the tokens the graph's fused race wrote, the very tokens the runner's
sampler gives for the same logits; they land in output slots that alternate from step to step; every
other step, and the graphs past head_rows, leave sampling to the runner. On CPU the race runs in Triton's
interpreter and the graphs run eagerly."""

import pytest
import torch
from conftest import PROMPTS, triton_test_device

from nanovllm import LLM, SamplingParams
from nanovllm.engine.step import StepBatch
from nanovllm.layers.sampler import Sampler
from nanovllm.runner.cuda_graph import NUM_OUT_SLOTS, DecodeGraphs
from nanovllm.runner.transfers import Uploads

pytest.importorskip("triton")

from nanovllm.kernels.sample_race import race  # noqa: E402

VOCAB = 300


class HeadModel(torch.nn.Module):
    """A model whose hidden state is its position, and whose logits are a fixed random projection of it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.head = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)).to(device)

    def forward(self, input_ids, positions, meta):
        return positions.float().unsqueeze(1).expand(-1, 8).clone()

    def compute_logits(self, hidden):
        return torch.sin(hidden[:, :1] * self.head) * 4


def decode_batch(seqlens: list[int]) -> StepBatch:
    n = len(seqlens)
    return StepBatch(is_prefill=False, input_ids=[1] * n, positions=[k - 1 for k in seqlens],
                     slot_mapping=list(range(n)), cu_seqlens_q=list(range(n + 1)), seqlens_k=seqlens,
                     block_tables=[[i] for i in range(n)], sample_rows=list(range(n)), sampling=None)


def step(graphs: DecodeGraphs, seqlens: list[int], race_rows=None):
    uploads = Uploads(graphs.static.device, 0)
    uploads.begin()
    staged = graphs.stage(decode_batch(seqlens), uploads, race_rows)
    uploads.flush()
    return graphs.replay(staged)


def test_small_graphs_sample_with_the_race_into_alternating_slots():
    device = torch.device(triton_test_device())  # the race's tensors: interpreted on the CPU, or CUDA
    graphs = DecodeGraphs(HeadModel(device), 8, 2, 8, torch.float32, device, use_cuda_graph=False,
                          batch_sizes=[1, 4, 8], head_rows=4, race=race)
    as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
    temps, seeds = [0.0, 0.7, 1.3], [11, 22, (1 << 62) + 5]
    first = step(graphs, [12, 30, 7], (temps, seeds))  # padded to the 4-row graph
    want = race(first.logits, as_tensor(temps), as_tensor(seeds))
    assert first.sampled.tolist() == want.tolist()
    assert first.sampled.tolist()[0] == first.logits[0].argmax().item()  # the greedy row
    assert first.sampled.data_ptr() == graphs.sampled.data_ptr()  # slot 0
    kept = first.sampled.clone()
    second = step(graphs, [40], ([0.9], [5]))
    assert second.sampled.data_ptr() == graphs.sampled[graphs.max_batch_size:].data_ptr()  # slot 1
    assert second.sampled.tolist() == race(second.logits, as_tensor([0.9]), as_tensor([5])).tolist()
    assert torch.equal(first.sampled, kept)  # the step before's tokens stay where they were
    # Without the rows' parameters the graph's tokens are not used (the runner samples the logits), but
    # the graph still wrote slot 0: the slot turns all the same...
    assert step(graphs, [3, 4], None).sampled is None
    # ... and past head_rows, where the graph has no LM head, nothing is sampled and the slot stays.
    assert step(graphs, [3, 4, 5, 6, 7], (temps + [0.5, 0.5], seeds + [1, 2])).sampled is None
    third = step(graphs, [9], ([0.9], [6]))
    assert NUM_OUT_SLOTS == 2  # so slot 1 again, not slot 0, whose graph ran two steps before
    assert third.sampled.data_ptr() == graphs.sampled[graphs.max_batch_size:].data_ptr()


def sampling_engine(path: str, graphs: bool, async_scheduling: bool) -> LLM:
    """A float32 engine whose sampler is the fused race (the one CUDA uses, here on the CPU too), decoding
    through the static buffers with the graphs' sampler (graphs=True) or eagerly (False)."""
    llm = LLM(path, attention_backend="torch", kvcache_block_size=4, max_model_len=128, max_num_seqs=8,
              dtype="float32", enforce_eager=True, num_kvcache_blocks=256, async_scheduling=async_scheduling)
    runner = llm.engine.executor
    runner.sampler.sampler = Sampler(fused_race=True)
    if graphs:
        runner.decode_graphs = DecodeGraphs(runner.model, 8, 128 // 4, runner.config.hf_config.hidden_size,
                                            runner.dtype, runner.device, use_cuda_graph=False,
                                            batch_sizes=[1, 2, 4, 8], head_rows=4,
                                            race=runner.sampler.graph_race())
    return llm


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlap"])
def test_graph_sampled_tokens_equal_the_runners(qwen3_dir, async_scheduling):
    """Seeded, unseeded (after the same torch.manual_seed) and greedy rows, and a row that asks for
    logprobs (its steps sample eagerly): token for token the eager sampler's."""
    triton_test_device()
    params = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=7),
              SamplingParams(temperature=1.1, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, logprobs=2)]
    outputs, sampled_steps = [], []
    for graphs in (False, True):
        llm = sampling_engine(qwen3_dir, graphs, async_scheduling)
        if graphs:
            decode_graphs = llm.engine.executor.decode_graphs

            def replay(*args, plain=decode_graphs.replay):
                out = plain(*args)
                sampled_steps.append(out.sampled is not None)
                return out

            decode_graphs.replay = replay
        torch.manual_seed(1234)
        outputs.append([o["token_ids"] for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)])
    assert outputs[1] == outputs[0]
    # Steps with the logprobs row sampled eagerly, those after it (3 rows or fewer) in the graph.
    assert any(sampled_steps) and not all(sampled_steps)
