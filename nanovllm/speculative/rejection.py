"""Which drafts a verification step keeps. Pure Python: it runs on the step's sampled ids, on the host,
after the step's one sync.

A row with drafts d_1..d_n samples the target model at each of its n + 1 positions with the ordinary
sampler (temperature, top-k, top-p, min-p; seeds mixed with each token's index, engine/step.with_drafts):
x_0 from p_0 = p(. | context), x_1 from p_1 = p(. | context, d_1), and so on. The row keeps d_1..d_a
while x_i == d_{i+1}, then emits x_a: the target's own token where the first draft differs, or, after
n accepted drafts, the bonus token x_n.

That is rejection sampling (Leviathan et al., Chen et al.) for a draft that proposes d with
probability 1, as the n-gram and greedy draft-model proposers do. Rejection sampling accepts d with
probability min(1, p(d) / q(d)) = p(d), and on rejection samples from max(0, p - q), normalized: p with
d removed and renormalized. Here: P(x == d) = p(d); and given x != d, x is distributed as p(x) / (1 -
p(d)) over x != d. The same law, so the output follows the target's distribution exactly, and:

- greedy rows (x_i = argmax p_i) accept a draft exactly when it is the target's argmax: the output is
  token for token plain greedy decoding's;
- a seeded row draws each token's noise from (seed, token index), as plain decoding does: it samples
  the same tokens with or without drafts."""


def accepted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a row emits: sampled (the target's token at each of its 1 + len(drafts) positions)
    while it agrees with the drafts, then the first that does not (or the bonus token)."""
    num_accepted = 0
    while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return sampled[:num_accepted + 1]
