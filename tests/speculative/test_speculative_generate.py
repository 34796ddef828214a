"""Speculative decoding end to end on a tiny random model (float32, CPU): greedy output is token for
token the output without speculation, for k = 1, 3 and 5, with stops, logprobs, n > 1, prefix caching,
chunked prefill, preemption and rows that do not speculate in the same batch; a seeded sampled request
samples the same tokens too; the counters come out as counted by hand; and disable_by_batch_size
switches proposals off. An oracle proposer (the reference continuation, some drafts spoiled) makes
accepted runs, rejections and bonus tokens happen where the test wants them."""

import pytest
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.speculative.decoding import QUIET_STEPS, SpecDecodeStats

pytestmark = pytest.mark.usefixtures("one_thread")
# float32 on a GPU too, where the engine's default is bfloat16 (greedy tokens equal only in float32)
OPTIONS = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=512, dtype="float32")
# Prompts that repeat themselves, so that prompt lookup finds n-grams.
REPEATING = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
             "hello world hello world hello world hello", "Paris is the capital of France. Paris is the",
             *PROMPTS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SCHEDULER_FEATURES = [
    dict(max_num_batched_tokens=16),  # chunked prefill; drafts trimmed to the budget
    dict(num_kvcache_blocks=24, max_num_seqs=4),  # preemption
    dict(enable_prefix_caching=False),
    dict(mixed_batches=False),
]


def ngram(k, **extra):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            **extra}


class Oracle:
    """Proposes the reference continuation of each prompt, wrong wherever `spoil(position)` says."""

    writes_kv = False

    def __init__(self, references: dict[tuple, list[int]], spoil=lambda position: position % 3 == 0):
        self.references, self.spoil = references, spoil

    def propose(self, seqs, num_tokens, pending=None):
        out = []
        for seq, num in zip(seqs, num_tokens):
            full = self.references[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            at = len(seq)
            out.append([(t + 1) % 300 if self.spoil(at + j) else t for j, t in enumerate(full[at:at + num])])
        return out

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def base(qwen3_dir):
    return LLM(qwen3_dir, **OPTIONS)


def with_oracle(llm, base, prompts, params, spoil=lambda position: position % 3 == 0):
    """Put an Oracle built from base's output for prompts in llm's engine."""
    params = params.clone()
    params.max_tokens += 8  # the oracle may look past the end
    refs = {tuple(o["prompt_token_ids"]): o["prompt_token_ids"] + o["token_ids"]
            for o in base.generate(prompts, params, use_tqdm=False)}
    llm.engine._spec.proposer = Oracle(refs, spoil)
    return llm


def assert_same(outputs, expected):
    for out, ref in zip(outputs, expected, strict=True):
        assert out["token_ids"] == ref["token_ids"]
        assert (out["text"], out["finish_reason"], out["stop_reason"]) == (
            ref["text"], ref["finish_reason"], ref["stop_reason"])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_matches_plain_decoding(qwen3_dir, base, k):
    llm = LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(k))
    outputs = llm.generate(REPEATING, GREEDY, use_tqdm=False)
    assert_same(outputs, base.generate(REPEATING, GREEDY, use_tqdm=False))
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(o.metrics.num_draft_tokens for o in outputs) == stats.num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outputs) == stats.num_accepted_tokens


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_runs_rejections_and_bonus_tokens_keep_greedy_output(qwen3_dir, base, k):
    llm = with_oracle(LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(k)), base, PROMPTS, GREEDY,
                      spoil=lambda position: position % 7 == 0)
    assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), base.generate(PROMPTS, GREEDY, use_tqdm=False))
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected drafts
    assert stats.num_accepted_tokens_per_pos[k - 1] > 0  # all k accepted, then a bonus token
    if k > 1:
        assert stats.num_accepted_tokens > stats.num_drafts  # runs of several accepted drafts


def test_counters_as_counted_by_hand(qwen3_dir, base):
    """k = 3, max_tokens = 10, one request. Always right: the first token comes with the prompt, then
    3 drafts + a bonus twice (9 tokens), then no room for a draft: a plain step. Always wrong: drafts of
    3, 2 and 1 (each capped by max_tokens 5), all rejected, then a plain step."""
    prompt = [PROMPTS[0]]
    right = with_oracle(LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3)), base, prompt,
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), spoil=lambda p: False)
    (out,) = right.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    assert len(out["token_ids"]) == 10 and dict(out.metrics) == {
        "num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 6}
    assert right.engine.stats().spec_decode == SpecDecodeStats(2, 6, 6, (2, 2, 2))
    wrong = with_oracle(LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3)), base, prompt,
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), spoil=lambda p: True)
    (out,) = wrong.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    assert len(out["token_ids"]) == 5
    assert wrong.engine.stats().spec_decode == SpecDecodeStats(3, 6, 0, (0, 0, 0))


def test_a_verification_step_reports_its_emitted_tokens_as_decoded(qwen3_dir, base):
    """k = 3, always right, one request of 10 tokens: the prefill step reports the prompt's tokens, then
    each verification step the 4 tokens it emitted (not its drafts, and not as prompt tokens), then the
    plain step its one."""
    prompt = [PROMPTS[0]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = with_oracle(LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3)), base, prompt, params,
                      spoil=lambda p: False)
    num_prompt = len(llm.engine.tokenizer.encode(prompt[0]))
    assert step_counts(llm, prompt[0], params) == [(num_prompt, 0), (0, 4), (0, 4), (0, 1)]


def step_counts(llm, prompt, params) -> list[tuple[int, int]]:
    """(prompt tokens, decoded tokens) of each engine step that runs `prompt` alone to its end."""
    engine = llm.engine
    engine.add_request(prompt, params)
    results = []
    while not engine.is_finished():
        result = engine.step()
        results.append((result.num_prefill_tokens, result.num_decode_tokens))
    return results


def test_stops_inside_an_accepted_run(qwen3_dir, base, tokenizer):
    """A stop token id, a stop string and EOS each land inside a run of accepted drafts; what follows
    is dropped, exactly as without speculation. max_tokens 7 with k = 5 ends on a bonus token."""
    llm = with_oracle(LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(5)), base, PROMPTS, GREEDY,
                      spoil=lambda p: False)
    plain = base.generate(PROMPTS, GREEDY, use_tqdm=False)
    stop_ids = [o["token_ids"][4] for o in plain]
    stop_strs = [tokenizer.decode(o["token_ids"][5:7]) for o in plain]
    for make in (lambda i: SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_ids[i]]),
                 lambda i: SamplingParams(temperature=0, max_tokens=40, stop=[stop_strs[i]]),
                 lambda i: SamplingParams(temperature=0, max_tokens=7)):
        for i, prompt in enumerate(PROMPTS):
            (out,) = llm.generate(prompt, make(i), use_tqdm=False)
            (ref,) = base.generate(prompt, make(i), use_tqdm=False)
            assert_same([out], [ref])
            assert out.metrics.num_accepted_tokens > 0


def test_logprobs_match_plain_decoding(qwen3_dir, base):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    llm = with_oracle(LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3)), base, PROMPTS, params)
    outputs, expected = llm.generate(PROMPTS, params, use_tqdm=False), base.generate(PROMPTS, params,
                                                                                     use_tqdm=False)
    assert_same(outputs, expected)
    for out, ref in zip(outputs, expected):
        assert len(out["logprobs"]) == len(ref["logprobs"]) == 20
        for a, b in zip(out["logprobs"], ref["logprobs"]):
            assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
            assert [lp.rank for lp in a.values()] == [lp.rank for lp in b.values()]
        assert out["cumulative_logprob"] == pytest.approx(ref["cumulative_logprob"], abs=1e-3)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_seeded_sampling_and_n_samples_match_plain_decoding(qwen3_dir, base):
    """Each token's noise comes from (seed, its index): speculation changes no seeded token."""
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=24, seed=7, n=2,
                            ignore_eos=True)
    llm = LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3))
    refs = {tuple(o["prompt_token_ids"]): o["prompt_token_ids"] + o["token_ids"]
            for o in base.generate(PROMPTS, params, use_tqdm=False)}  # completion 0's continuation
    llm.engine._spec.proposer = Oracle({**refs}, spoil=lambda p: p % 4 == 0)
    outputs, expected = llm.generate(PROMPTS, params, use_tqdm=False), base.generate(PROMPTS, params,
                                                                                     use_tqdm=False)
    for out, ref in zip(outputs, expected):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("options", SCHEDULER_FEATURES)
def test_scheduler_features_keep_greedy_output(qwen3_dir, base, options):
    llm = with_oracle(LLM(qwen3_dir, **{**OPTIONS, **options}, speculative_config=ngram(3)), base, REPEATING,
                      GREEDY)
    assert_runs_twice_as_plain(llm, base, options)


def assert_runs_twice_as_plain(llm, base, options) -> None:
    """REPEATING, greedy, gives base's output twice (prefix cache hits the second time, if on), with
    drafts accepted, and with preemption where `options` shrink the cache."""
    expected = base.generate(REPEATING, GREEDY, use_tqdm=False)
    assert_same(llm.generate(REPEATING, GREEDY, use_tqdm=False), expected)
    assert_same(llm.generate(REPEATING, GREEDY, use_tqdm=False), expected)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    if "num_kvcache_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_rows_with_logits_processors_speculate_with_per_position_processors(qwen3_dir, base):
    """Penalties, bad words, min_tokens, logit_bias and allowed_token_ids rows speculate: each verified
    position's processors take the drafts before it as output (penalties count them, a bad word's prefix
    may end in them, min_tokens counts past them). The drafts are each row's own continuation, mostly
    right, so a position whose processors missed the drafts before it would pick what they forbid: the
    output is the plain engine's, greedy and seeded."""
    extras = (dict(presence_penalty=2.0), dict(repetition_penalty=3.0, frequency_penalty=2.0),
              dict(bad_words=["the", "a b"]), dict(min_tokens=25),
              dict(logit_bias={7: 2.0, 11: -5.0}, allowed_token_ids=list(range(3, 300))))
    prompts = PROMPTS + [PROMPTS[0] + " and then some more"]  # five prompts: the oracle keys by prompt
    for temperature in (0.0, 0.8):
        params = [SamplingParams(temperature=temperature, seed=1, max_tokens=40, ignore_eos=True, **extra)
                  for extra in extras]
        expected = base.generate(prompts, params, use_tqdm=False)
        longer = [p.clone() for p in params]
        for p in longer:
            p.max_tokens += 8  # the oracle may look past the end
        refs = {tuple(o["prompt_token_ids"]): o["prompt_token_ids"] + o["token_ids"]
                for o in base.generate(prompts, longer, use_tqdm=False)}
        llm = LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3))
        llm.engine._spec.proposer = Oracle(refs, spoil=lambda p: p % 6 == 0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_same(outputs, expected)
        assert all(o.metrics.num_accepted_tokens > 0 for o in outputs)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_structured_output_rows_speculate_within_their_grammar(qwen3_dir, base, temperature):
    """A constrained row verifies only drafts its grammar allows (the rest are cut at the proposal), and
    each verified position's bitmask is its matcher's after the drafts before it: the output is the
    plain engine's, drafts accepted and rejected."""
    pytest.importorskip("xgrammar")
    constraints = [dict(regex="[ab]+ [cd]+ [ab]+"), dict(choice=["alpha beta gamma", "alpha beta delta"]),
                   dict(regex="(ab|cd)+")]
    params = [SamplingParams(temperature=temperature, seed=2, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(**c)) for c in constraints] + [GREEDY]
    expected = base.generate(PROMPTS, params, use_tqdm=False)
    refs = {tuple(o["prompt_token_ids"]): o["prompt_token_ids"] + o["token_ids"] + [0] * 8 for o in expected}
    llm = LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3))
    llm.engine._spec.proposer = Oracle(refs, spoil=lambda p: p % 5 == 0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_same(outputs, expected)
    assert outputs[1]["text"] in ("alpha beta gamma", "alpha beta delta")
    stats = llm.engine.stats().spec_decode
    assert all(o.metrics.num_accepted_tokens > 0 for o in outputs[:3])
    assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_grammar_prefix_cuts_drafts_the_grammar_forbids_and_leaves_the_matcher(tokenizer):
    xgrammar = pytest.importorskip("xgrammar")
    from nanovllm.engine.structured_outputs import GrammarCompiler, grammar_matcher, grammar_prefix

    compiled = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,)).compile(
        StructuredOutputsParams(regex="ab+"))
    matcher = grammar_matcher(compiled)
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    assert grammar_prefix(matcher, [a, b, b, a, b]) == [a, b, b]  # a second "a" breaks "ab+"
    assert grammar_prefix(matcher, [b]) == []  # the matcher still expects the first "a"
    bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = [i for i in range(len(tokenizer)) if bitmask[0, i // 32] >> (i % 32) & 1]
    assert a in allowed and b not in allowed


@pytest.mark.parametrize("max_tokens", [[40, 12, 25, 33], [9, 9, 40, 40]])
def test_overlap_loop_above_the_limit_synchronous_with_drafts_below(qwen3_dir, base, max_tokens):
    """With async_scheduling, more than disable_by_batch_size running requests run the overlap loop
    (no drafts); as they finish, the engine drains the step in flight and speculates synchronously."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    llm = LLM(qwen3_dir, **OPTIONS, async_scheduling=True,
              speculative_config=ngram(3, disable_by_batch_size=2))
    with_oracle(llm, base, PROMPTS, GREEDY, spoil=lambda p: p % 5 == 0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_same(outputs, base.generate(PROMPTS, params, use_tqdm=False))
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    assert outputs[max_tokens.index(min(max_tokens))].metrics.num_drafts == 0  # done before any draft
    # Back above the limit: drafts left over are dropped, and the overlap loop runs again.
    outputs = llm.generate(PROMPTS + PROMPTS, params + params, use_tqdm=False)
    assert_same(outputs, base.generate(PROMPTS + PROMPTS, params + params, use_tqdm=False))


def test_disable_by_batch_size_switches_proposals_off(qwen3_dir, base):
    llm = LLM(qwen3_dir, **OPTIONS, speculative_config=ngram(3, disable_by_batch_size=3))
    llm.engine._spec.proposer = Oracle({}, spoil=lambda p: False)  # would fail if ever asked
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # four requests run together
    assert_same(outputs, base.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert llm.engine.stats().spec_decode == SpecDecodeStats(0, 0, 0, (0, 0, 0))
    with_oracle(llm, base, PROMPTS[:3], GREEDY)
    llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)  # three: at the limit, they speculate
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_overlap_loop_while_the_proposer_finds_nothing(qwen3_dir, base):
    """A round with no draft at all rests the proposer QUIET_STEPS steps, which run the overlap loop."""
    calls = []

    class Empty(Oracle):
        def propose(self, seqs, num_tokens, pending=None):
            calls.append(len(seqs))
            return [[] for _ in seqs]

    params = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)
    for async_scheduling, most in ((False, 45), (True, 45 // (QUIET_STEPS + 1) + 2)):
        calls.clear()
        llm = LLM(qwen3_dir, **OPTIONS, async_scheduling=async_scheduling, speculative_config=ngram(3))
        llm.engine._spec.proposer = Empty({})
        assert_same(llm.generate(PROMPTS[:1], params, use_tqdm=False),
                    base.generate(PROMPTS[:1], params, use_tqdm=False))
        assert 0 < len(calls) <= most
