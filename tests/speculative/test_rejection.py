"""Verification keeps the target model's distribution: a row with a draft samples the target at each
position with the ordinary sampler and keeps the draft where the sample equals it. Over many seeded draws
the first emitted token follows p (top-k / top-p applied) whether the draft is likely or not, the draft is
accepted with probability p(draft), and a seeded row samples what plain decoding samples."""

import pytest
import torch

from nanovllm.engine.step import SEED_MASK, SEED_STRIDE, SamplingBatch, with_drafts
from nanovllm.runner.sampling import StepSampler
from nanovllm.speculative.rejection import accepted_tokens

VOCAB = 8
P = torch.tensor([0.40, 0.25, 0.15, 0.08, 0.05, 0.04, 0.02, 0.01])
NUM_DRAWS = 20000
# Total variation between NUM_DRAWS samples over 8 tokens and their law is ~0.01 (sqrt(V / N) / 2).
MAX_TV = 0.025


def test_accepted_tokens_keeps_the_agreeing_prefix_and_the_next_sample():
    assert accepted_tokens([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]  # third draft rejected: 7 instead
    assert accepted_tokens([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, then the bonus 8
    assert accepted_tokens([4, 6], [5]) == [4]
    assert accepted_tokens([4], []) == [4]


def draw(draft: int, top_k: int = -1, top_p: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, float]:
    """NUM_DRAWS rows, each verifying one draft: position 0 samples from P, position 1 (the bonus) from
    anything. Returns each row's first emitted token and the acceptance rate."""
    torch.manual_seed(seed)
    base = SamplingBatch([1.0] * NUM_DRAWS, [top_k] * NUM_DRAWS, [top_p] * NUM_DRAWS, [0.0] * NUM_DRAWS,
                         [None] * NUM_DRAWS, [None] * NUM_DRAWS)
    sampling = with_drafts(base, [[draft]] * NUM_DRAWS)
    logits = P.log().repeat(2 * NUM_DRAWS, 1)
    tokens, _ = StepSampler(VOCAB, torch.device("cpu"), compiled=False).sample(logits, sampling)
    sampled = tokens.view(NUM_DRAWS, 2).tolist()
    emitted = [accepted_tokens(row, [draft]) for row in sampled]
    first = torch.tensor([row[0] for row in emitted])
    return first, sum(len(row) == 2 for row in emitted) / NUM_DRAWS


def total_variation(tokens: torch.Tensor, law: torch.Tensor) -> float:
    histogram = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
    return 0.5 * (histogram - law).abs().sum().item()


@pytest.mark.parametrize("draft", [0, 4, 7])  # likely, unlikely, rarest
def test_first_token_follows_the_target_distribution(draft):
    first, acceptance = draw(draft)
    assert total_variation(first, P) < MAX_TV
    assert acceptance == pytest.approx(P[draft].item(), abs=0.01)
    # A sampler that always took the draft would be all mass on it: far from P.
    assert total_variation(torch.full((NUM_DRAWS,), draft), P) > 0.5


def test_top_k_and_top_p_are_respected():
    first, acceptance = draw(draft=5, top_k=3, seed=1)
    top3 = torch.zeros(VOCAB)
    top3[:3] = P[:3] / P[:3].sum()
    assert set(first.tolist()) <= {0, 1, 2} and acceptance == 0.0  # the draft lies outside the top 3
    assert total_variation(first, top3) < MAX_TV
    first, _ = draw(draft=1, top_p=0.6, seed=2)  # 0.40 + 0.25 reaches 0.6: tokens 0 and 1 stay
    assert set(first.tolist()) <= {0, 1}
    assert total_variation(first, torch.tensor([0.4, 0.25, 0, 0, 0, 0, 0, 0]) / 0.65) < MAX_TV


def test_seeded_positions_sample_what_plain_decoding_would():
    """Position j of a seeded row uses the seed of the request's token num_completion_tokens + j."""
    sampler = StepSampler(VOCAB, torch.device("cpu"), compiled=False)
    seed, num_completion_tokens = 1234, 7
    mixed = (seed * SEED_STRIDE + num_completion_tokens) & SEED_MASK
    logits = torch.randn(3, VOCAB) * 2
    spec = with_drafts(SamplingBatch([0.9], [-1], [1.0], [0.0], [mixed], [None]), [[1, 2]])
    assert spec.seeds == [(seed * SEED_STRIDE + num_completion_tokens + j) & SEED_MASK for j in range(3)]
    together, _ = sampler.sample(logits, spec)
    for j in range(3):
        alone = SamplingBatch([0.9], [-1], [1.0], [0.0], [spec.seeds[j]], [None])
        assert sampler.sample(logits[j:j + 1], alone)[0].item() == together[j].item()
