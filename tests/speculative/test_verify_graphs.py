"""Verification steps as decode rows (runner/verify_graphs.py): a step verifying k drafts of a sequence runs
as k + 1 decode rows sharing its block table, in the decode graphs' static-buffer path (here eagerly on the
CPU, DecodeGraphs(use_cuda_graph=False), as the GPU replays it captured). Output equals the plain engine's,
greedy and seeded; steps the graphs cannot take (too many rows) keep the prefill path; and with the Triton
backend the rows never meet the fused store-and-attend decode kernel, whose rows could race."""

import pytest
import torch
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.attention.triton_backend import TritonBackend
from nanovllm.engine.step import PromptLogprobSpan, StepBatch
from nanovllm.runner import verify_graphs
from nanovllm.runner.cuda_graph import HEAD_GRAPH_MAX_ROWS, DecodeGraphs
from nanovllm.runner.verify_graphs import as_decode_rows, verify_graph_rows

pytestmark = pytest.mark.usefixtures("one_thread")
ON_GPU = torch.cuda.is_available()
# float32 on a GPU too, where the engine's default is bfloat16 (greedy tokens equal only in float32)
OPTIONS = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=32,
               max_num_batched_tokens=512, dtype="float32")
REPEATING = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
             "hello world hello world hello world hello", "Paris is the capital of France. Paris is the",
             PROMPTS[1]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def verification(spec=([21, 22], []), **changes) -> StepBatch:
    """Sequence 0 verifies two drafts at positions 10-12 (its last token 20), sequence 1 decodes at 5."""
    fields = dict(is_prefill=True, input_ids=[20, *spec[0], 30], positions=[10, 11, 12, 5],
                  slot_mapping=[40, 41, 42, 13], cu_seqlens_q=[0, 3, 4], seqlens_k=[13, 6],
                  block_tables=[[7, 8, 10, 11], [3, 4]], sample_rows=[0, 1], sampling=None,
                  spec_token_ids=[list(s) for s in spec])
    fields.update(changes)
    return StepBatch(**fields)


def test_a_verification_step_becomes_one_decode_row_a_position():
    batch = verification()
    rows = as_decode_rows(batch)
    assert not rows.is_prefill and rows.num_seqs == 4
    assert (rows.input_ids, rows.positions, rows.slot_mapping) == ([20, 21, 22, 30], [10, 11, 12, 5],
                                                                   [40, 41, 42, 13])
    assert rows.seqlens_k == [11, 12, 13, 6]  # each position sees itself and what is before it
    assert rows.block_tables == [[7, 8, 10, 11]] * 3 + [[3, 4]]
    # Every row samples, in the order the verification's logits are sampled.
    assert rows.sample_rows == [0, 1, 2, 3] and rows.logits_indices == batch.logits_indices
    assert not rows.spec_token_ids


@pytest.mark.parametrize("changes", [
    dict(spec_token_ids=[]),  # nothing to verify
    dict(sample_rows=[1], spec_token_ids=[[]]),  # sequence 0 computes a prompt chunk
    dict(prompt_logprob_spans=[PromptLogprobSpan(1, 3, 1, [])]),
])
def test_steps_that_are_not_verification_alone_stay_as_they_are(changes):
    assert as_decode_rows(verification(**changes)) is None


def test_a_token_the_previous_step_still_samples_keeps_its_index_as_a_row():
    """Overlap scheduling: sequence 0's last token (input 0) and sequence 1's (input 3) come from the
    previous step's sampled ids; one token a row, the indices stand."""
    rows = as_decode_rows(verification(prev_token_indices=[0, 3], prev_token_rows=[5, 2]))
    assert (rows.prev_token_indices, rows.prev_token_rows) == ([0, 3], [5, 2])


@pytest.mark.parametrize("params", ["greedy", "seeded"])
def test_overlapped_verification_in_the_decode_graph_path_keeps_the_output(qwen3_dir, plain, params):
    """async_scheduling: verification rows whose first token the step before still samples, fed in the
    graphs' static buffers as decode rows are."""
    with LLM(qwen3_dir, speculative_config=NGRAM, async_scheduling=True, **OPTIONS) as llm:
        staged = with_verify_graphs(llm.engine.executor, max_rows=32)
        fed = fed_steps(llm)
        outputs = llm.generate(REPEATING, GREEDY if params == "greedy" else SEEDED, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == plain[params]
    assert staged and any(fed)


def test_the_graphs_are_sized_for_the_largest_verification(qwen3_dir):
    with LLM(qwen3_dir, speculative_config=dict(NGRAM, disable_by_batch_size=4), **OPTIONS) as llm:
        config = llm.engine.executor.config
        assert verify_graph_rows(config, 512) == 4 * 4  # 4 sequences x (k + 1)
        assert verify_graph_rows(config, 8) == 8  # never more than the decode graphs take


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        return {name: [o["token_ids"] for o in llm.generate(REPEATING, params, use_tqdm=False)]
                for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def with_verify_graphs(runner, max_rows: int, record=lambda batch: batch.num_seqs) -> list:
    """Give a CPU runner (an engine's executor, or a draft model's) the verification graph set, run
    eagerly; returns record(batch) (its rows) of each step it ran, filled in as the engine runs."""
    graphs = runner.verify_graphs = DecodeGraphs(
        runner.model, max_rows, 256 // 4, runner.config.hf_config.hidden_size, runner.dtype, runner.device,
        use_cuda_graph=False, head_rows=HEAD_GRAPH_MAX_ROWS, race=runner.sampler.graph_race(),
        shared_rows=True)
    staged, stage = [], graphs.stage
    graphs.stage = lambda batch, *rest: staged.append(record(batch)) or stage(batch, *rest)
    return staged


def fed_steps(llm: LLM) -> list[bool]:
    """Per step staged in the verification graphs, whether it took tokens from the step before; filled in
    as the engine runs."""
    fed, graphs = [], llm.engine.executor.verify_graphs
    stage = graphs.stage
    graphs.stage = lambda batch, *rest: fed.append(bool(batch.prev_token_indices)) or stage(batch, *rest)
    return fed


@pytest.mark.parametrize("params", ["greedy", "seeded"])
def test_verification_in_the_decode_graph_path_keeps_the_output(qwen3_dir, plain, params):
    with LLM(qwen3_dir, speculative_config=NGRAM, **OPTIONS) as llm:
        staged = with_verify_graphs(llm.engine.executor, max_rows=32)
        outputs = llm.generate(REPEATING, GREEDY if params == "greedy" else SEEDED, use_tqdm=False)
        spec = llm.engine.stats().spec_decode
    assert [o["token_ids"] for o in outputs] == plain[params]
    assert staged and max(staged) > len(REPEATING)  # several rows a sequence: drafts verified as rows
    # The tiny model's greedy output repeats its prompts in float32 (the CPU); in bf16 on a GPU it need not.
    assert spec.num_draft_tokens > 0 and (params == "seeded" or spec.num_accepted_tokens > 0 or ON_GPU)


def test_a_verification_larger_than_the_graphs_takes_the_prefill_path(qwen3_dir, plain, monkeypatch):
    verifications = []  # the rows of every verification step, staged or not
    as_rows = verify_graphs.as_decode_rows

    def recorded(batch):
        rows = as_rows(batch)
        if rows is not None:
            verifications.append(rows.num_seqs)
        return rows

    monkeypatch.setattr(verify_graphs, "as_decode_rows", recorded)
    # The first request runs on alone after the others: then its verifications fit (k + 1 = 4 rows).
    params = [GREEDY] + [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3
    with LLM(qwen3_dir, speculative_config=NGRAM, **OPTIONS) as llm:
        staged = with_verify_graphs(llm.engine.executor, max_rows=4)
        outputs = llm.generate(REPEATING, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [plain["greedy"][0]] + [t[:8] for t in plain["greedy"][1:]]
    assert staged == [n for n in verifications if n <= 4] and (max(verifications) > 4 or ON_GPU)


@pytest.fixture(scope="module")
def triton_greedy(qwen3_dir) -> list[list[int]]:
    """The plain engine's greedy tokens of REPEATING[:2] on the Triton backend (interpreted on the CPU:
    slow, so computed once for the module)."""
    from conftest import triton_test_device
    triton_test_device()
    with LLM(qwen3_dir, attention_backend="triton", **OPTIONS) as llm:
        return [o["token_ids"] for o in llm.generate(REPEATING[:2], GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_with_the_triton_backend_verification_rows_store_before_they_attend(qwen3_dir, monkeypatch,
                                                                             triton_greedy, async_scheduling):
    """The fused decode kernel stores a row's K/V and attends in one program: rows of one sequence could
    read a position before its row stored it. Verification rows take the store-then-attend path, also
    in the overlap loop, where a verification's first token comes from the step before on the device."""
    expected = triton_greedy
    shared, fused_shared = [], []  # shared: inside a forward of rows that share sequences
    fused, forward = TritonBackend._fused_decode, TritonBackend.forward

    def spied_forward(self, layer, q, k, v, positions, meta):
        shared.append(meta.rows_share_sequences)
        try:
            return forward(self, layer, q, k, v, positions, meta)
        finally:
            shared.pop()

    def spied_fused(self, *args):
        fused_shared.append(shared[-1] if shared else None)  # None: the GPU's kernel warm-up
        return fused(self, *args)

    monkeypatch.setattr(TritonBackend, "forward", spied_forward)
    monkeypatch.setattr(TritonBackend, "_fused_decode", spied_fused)
    with LLM(qwen3_dir, attention_backend="triton", speculative_config=NGRAM,
             async_scheduling=async_scheduling, **OPTIONS) as llm:
        staged = with_verify_graphs(llm.engine.executor, max_rows=32)
        fed = fed_steps(llm)
        outputs = llm.generate(REPEATING[:2], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    assert any(fed) == async_scheduling
    assert staged and max(staged) > 2
    assert False in fused_shared and True not in fused_shared  # plain decode rows fused, verification not


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_start_up_captures_the_verification_set_beside_the_decode_graphs(qwen3_dir, monkeypatch, spec):
    """runner/verify_graphs.capture_decode_graphs, as the GPU runner calls it (the captures themselves
    stubbed: CUDA graphs need a GPU): the verification set only with speculative_config, rows that share
    sequences, in the decode graphs' memory pool, with their LM head and race."""
    captured = []

    def capture(self):  # a capture makes a memory pool where it was given none
        captured.append(self)
        self.pool = self.pool or f"pool of graph set {len(captured)}"

    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    with LLM(qwen3_dir, speculative_config=spec, **OPTIONS) as llm:
        runner = llm.engine.executor
        captured.clear()  # on a GPU the engine's start-up captured its own
        graphs, verify = verify_graphs.capture_decode_graphs(runner.model, runner.config, 32, 64,
                                                             runner.dtype, runner.device, None)
    assert not graphs.shared_rows and graphs.max_batch_size == 32 and graphs.head_rows == HEAD_GRAPH_MAX_ROWS
    if spec is None:
        assert verify is None and captured == [graphs]
        return
    assert captured == [graphs, verify] and verify.shared_rows and verify.pool == "pool of graph set 1"
    assert verify.max_batch_size == 32 and verify.head_rows == graphs.head_rows and verify.width == 64
