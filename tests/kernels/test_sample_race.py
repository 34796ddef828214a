"""The fused race (kernels/sample_race.py) on CPU tensors through the Triton interpreter (or on CUDA with
TRITON_INTERPRET=0): greedy rows give torch's argmax, ties and chunk borders included; a seeded row's
token depends on its seed alone; sampled tokens follow softmax(logits / T), min-p's floor applied; and
the Sampler takes the fused path whenever it has the rows' seeds."""

import math

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.engine.step import SEED_MASK, SamplingBatch  # noqa: E402
from nanovllm.kernels.sample_race import BLOCK, greedy, num_chunks, race  # noqa: E402
from nanovllm.layers.sampler import SPLIT_ARGMAX_ROWS, Sampler, SamplingTensors  # noqa: E402
from nanovllm.runner.inputs import sampling_tensors  # noqa: E402
from nanovllm.runner.sampling import step_noise_seed  # noqa: E402

DEVICE = triton_test_device()


def seeds_of(*values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_sms", [1, 8])  # one chunk per row, or several
def test_greedy_rows_match_torch_argmax(dtype, num_sms):
    vocab = 3 * BLOCK + 100  # a partial last loop step
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, 5] = logits[1, vocab - 3] = 50.0  # a tie across chunks: the first wins
    logits[2, BLOCK - 1] = logits[2, BLOCK] = 50.0  # a tie across loop steps
    logits[3] = float("-inf")
    logits[3, vocab - 1] = 0.0  # the only finite token, in the last partial step
    assert num_sms == 1 or num_chunks(4, vocab, num_sms) > 1
    got = race(logits.to(DEVICE), torch.zeros(4, device=DEVICE), seeds_of(1, 2, 3, 4), num_sms=num_sms)
    assert got.tolist() == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_sms", [1, 8])
def test_greedy_variant_matches_torch_argmax(dtype, num_sms):
    """The noise-free variant (no temperatures, no seeds): the same ties and borders as the race's."""
    vocab = 3 * BLOCK + 100
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(7)).to(dtype)
    logits[1, 5] = logits[1, vocab - 3] = 50.0  # a tie across chunks: the first wins
    logits[2, BLOCK - 1] = logits[2, BLOCK] = 50.0  # a tie across loop steps
    logits[3] = float("-inf")
    logits[3, vocab - 1] = 0.0  # the only finite token, in the last partial step
    logits[4, 300] = logits[4, 300 + 256] = 60.0  # a tie within one lane (a sub-block apart)
    assert greedy(logits.to(DEVICE), num_sms=num_sms).tolist() == logits.float().argmax(-1).tolist()
    assert greedy(logits[:0].to(DEVICE)).tolist() == []


def test_seeded_row_depends_on_its_seed_only():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2000, generator=gen).to(DEVICE)
    temps = torch.ones(3, device=DEVICE)
    alone = race(logits[2:], temps[2:], seeds_of(77), num_sms=8)
    batched = race(logits, temps, seeds_of(5, 6, 77), num_sms=8)
    assert batched[2] == alone[0]
    assert race(logits, temps, seeds_of(5, 6, 77), num_sms=8).tolist() == batched.tolist()
    others = {race(logits[2:], temps[2:], seeds_of(seed), num_sms=8).item() for seed in range(8)}
    assert len(others) > 1  # other seeds, other draws from a flat distribution


def test_samples_follow_softmax_of_scaled_logits():
    rows, temperature = 600, 0.8
    probe = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, float("-inf")])
    logits = probe.repeat(rows, 1).to(DEVICE)
    seeds = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    tokens = race(logits, torch.full((rows,), temperature, device=DEVICE), seeds)
    freq = torch.bincount(tokens.cpu(), minlength=len(probe)).double() / rows
    want = (probe.double() / temperature).softmax(-1)
    assert freq[-1] == 0  # a -inf token is never drawn
    for f, p in zip(freq.tolist(), want.tolist(), strict=True):
        assert abs(f - p) <= 4.5 * math.sqrt(p * (1 - p) / rows) + 1e-9, (freq, want)


def test_bad_shapes_raise_value_error():
    logits = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="one entry per row"):
        race(logits, torch.ones(2, device=DEVICE), seeds_of(1, 2), torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="one entry per row"):
        race(logits, torch.ones(3, device=DEVICE), seeds_of(1, 2), num_sms=1)
    with pytest.raises(ValueError, match="contiguous rows"):
        race(logits.t(), torch.ones(10, device=DEVICE), seeds_of(*range(10)), num_sms=1)
    out = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="go together"):
        race(logits, torch.ones(2, device=DEVICE), seeds_of(1, 2), out=out)
    with pytest.raises(ValueError, match="out_rows"):
        race(logits, torch.ones(2, device=DEVICE), seeds_of(1, 2), out=out,
             out_rows=torch.tensor([0, 1], device=DEVICE))  # int64 indices


def test_out_rows_put_each_rows_token_where_they_say():
    """A decode graph's static output: row r's token lands at out[out_rows[r]], nothing else is written."""
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    temps, seeds = torch.tensor([0.0, 0.8, 1.2], device=DEVICE), seeds_of(4, 5, 6)
    out = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([6, 3, 4], dtype=torch.int32, device=DEVICE)
    assert race(logits, temps, seeds, out=out, out_rows=rows, num_sms=8) is out
    want = race(logits, temps, seeds, num_sms=8).tolist()
    assert out.tolist() == [-1, -1, -1, want[1], want[2], -1, want[0], -1]


def test_min_p_drops_tokens_below_its_floor_and_keeps_the_distribution_of_the_rest():
    rows, temperature = 600, 0.8
    probe = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, float("-inf")])
    logits = probe.repeat(rows, 1).to(DEVICE)
    seeds = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    temps = torch.full((rows,), temperature, device=DEVICE)
    temps[0] = 0.0  # a greedy row: min-p leaves it alone
    min_ps = torch.full((rows,), 0.2, device=DEVICE)
    tokens = race(logits, temps, seeds, min_ps).cpu()
    assert tokens[0] == 2
    scaled = probe.double() / temperature
    kept = scaled >= scaled.max() + math.log(0.2)  # tokens 1 and 2
    want = torch.where(kept, scaled, float("-inf")).softmax(-1)
    freq = torch.bincount(tokens[1:], minlength=len(probe)).double() / (rows - 1)
    assert kept.tolist() == [False, True, True, False, False, False]
    for f, p in zip(freq.tolist(), want.tolist(), strict=True):
        assert abs(f - p) <= 4.5 * math.sqrt(p * (1 - p) / (rows - 1)) + 1e-9, (freq, want)
    # min_p = 1 keeps the top token only (its own score is the floor: never below it).
    assert race(logits[:8], temps[:8], seeds[:8], torch.ones(8, device=DEVICE)).tolist() == [2] * 8


def test_sampler_takes_the_fused_race_with_top_k_and_min_p(monkeypatch):
    from nanovllm.layers import sampler as sampler_module

    def pytorch_race(*args):
        raise AssertionError("the PyTorch race ran")
    monkeypatch.setattr(sampler_module, "_race", pytorch_race)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 300, generator=gen).to(DEVICE)
    temps, seeds = torch.ones(2, device=DEVICE), seeds_of(11, 12)
    sampler = Sampler(fused_race=True)
    fused = sampler(logits, SamplingTensors(temps, all_greedy=False, seeds=seeds))
    assert fused.tolist() == race(logits, temps, seeds).tolist()
    top_k = SamplingTensors(temps, all_greedy=False, seeds=seeds, max_top_k=1,
                            top_ks=torch.ones(2, dtype=torch.int64, device=DEVICE))
    assert sampler(logits, top_k).tolist() == logits.argmax(-1).tolist()  # top-k = 1 is greedy
    min_p = SamplingTensors(temps, all_greedy=False, seeds=seeds, min_ps=torch.ones(2, device=DEVICE))
    assert sampler(logits, min_p).tolist() == logits.argmax(-1).tolist()  # min_p = 1: the top only
    without_seeds = SamplingTensors(temps, all_greedy=False)  # the caller gave none: the PyTorch race
    with pytest.raises(AssertionError, match="the PyTorch race ran"):
        sampler(logits, without_seeds)


def test_sampler_takes_the_greedy_variant_for_a_few_greedy_rows(monkeypatch):
    from nanovllm.layers import sampler as sampler_module

    taken = []
    monkeypatch.setattr(sampler_module, "row_argmax", lambda x: taken.append(x.shape[0]) or x.argmax(-1))
    logits = torch.randn(SPLIT_ARGMAX_ROWS, 3000, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    sampler, greedy_rows = Sampler(fused_race=True), SamplingTensors(None, all_greedy=True)
    assert sampler(logits[:3], greedy_rows).tolist() == logits[:3].argmax(-1).tolist()
    assert taken == []  # the Triton variant ran
    assert sampler(logits, greedy_rows).tolist() == logits.argmax(-1).tolist()
    assert taken == [SPLIT_ARGMAX_ROWS]  # from SPLIT_ARGMAX_ROWS rows torch's argmax is one kernel
    assert Sampler()(logits[:3], greedy_rows).tolist() == logits[:3].argmax(-1).tolist()  # no Triton: torch


def test_step_seeds_keep_request_seeds_and_vary_the_others():
    batch = SamplingBatch([0.7, 0.7, 0.0], [-1] * 3, [1.0] * 3, [0.0] * 3, [None, 1234, None], [None] * 3)
    assert sampling_tensors(batch, 100, torch.device("cpu")).seeds is None  # not asked for
    seeds = sampling_tensors(batch, 100, torch.device("cpu"), noise_seed=SEED_MASK).seeds.tolist()
    assert seeds[1] == 1234  # a request's own seed, whatever the step's
    assert seeds[0] != seeds[2] and all(0 <= s <= SEED_MASK for s in seeds)  # wrapped, distinct per row


def test_step_noise_seed_follows_torch_manual_seed():
    # So LLM(seed=...) fixes the unseeded rows' noise, and data-parallel replicas, each re-seeded with
    # seed + index after start-up, draw different noise.
    torch.manual_seed(5)
    first = [step_noise_seed() for _ in range(3)]
    torch.manual_seed(5)
    assert [step_noise_seed() for _ in range(3)] == first
    assert len(set(first)) == 3
    torch.manual_seed(6)
    assert step_noise_seed() not in first
