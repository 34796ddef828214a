"""A request as the engine holds it: its n sequences (one per completion, all over the same prompt),
built from a validated SamplingParams; what each step adds to them (tokens, logprobs); and the output
dict made from them once all have finished. Pure Python.

n > 1: completion i samples with seed + i (reproducible and distinct), and completions 1..n-1 wait
for completion 0 (their leader) to compute the prompt, then find its KV blocks in the prefix cache.
Only the leader computes prompt logprobs (which keeps it off the prefix cache)."""

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import decode_options
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.runner.batch import StepOutput
from nanovllm.sampling_params import SamplingParams


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Each bad word's token ids as it would appear in text: as written and, when it tokenizes to a
    different first token with as many tokens, after a space (vLLM's rule)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def make_sequences(token_ids: list[int], params: SamplingParams, block_size: int,
                   eos_token_ids: tuple[int, ...], tokenizer) -> list[Sequence]:
    """The n sequences of one request (params already validated)."""
    bad_words = bad_words_token_ids(params.bad_words, tokenizer) if params.bad_words else []
    # min_tokens masks what could end the sequence early: its stop ids and, unless ignored, EOS.
    min_tokens_stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else
                                                               set(eos_token_ids)))
    seqs: list[Sequence] = []
    for index in range(params.n):
        seq = Sequence(token_ids, params, block_size)
        seq.completion_index = index
        seq.seed = None if params.seed is None else params.seed + index
        seq.bad_words_token_ids = bad_words
        seq.min_tokens_stop_ids = min_tokens_stop_ids if params.min_tokens else []
        if index:
            seq.leader = seqs[0]
            seq.prompt_logprobs = None
        seqs.append(seq)
    return seqs


def record_step(seqs: list[Sequence], sample_rows: list[int], out: StepOutput) -> list[int | None]:
    """The sampled token of each of a step's sequences (None for those that only computed part of
    their prompt, and for those that finished while the step ran: overlap scheduling drops their
    token); records on them the logprobs and prompt logprobs they asked for."""
    token_ids: list[int | None] = [None] * len(seqs)
    for i, (row, token) in enumerate(zip(sample_rows, out.token_ids, strict=True)):
        if seqs[row].is_finished:
            continue
        token_ids[row] = token
        if out.logprobs is not None and out.logprobs[i] is not None:
            seqs[row].logprobs.append(out.logprobs[i])
            seqs[row].cumulative_logprob += out.logprobs[i][token]
    for row, logprobs in (out.prompt_logprobs or {}).items():
        if not seqs[row].is_finished:
            seqs[row].prompt_logprobs.extend(logprobs)
    return token_ids


def _completion(seq: Sequence, tokenizer) -> CompletionOutput:
    params = seq.sampling_params
    if not params.detokenize or tokenizer is None:
        text = ""
    elif seq.stop_text is not None:
        text = seq.stop_text
    else:
        text = tokenizer.decode(seq.completion_token_ids, **decode_options(seq))
    return {"index": seq.completion_index, "text": text, "token_ids": seq.completion_token_ids,
            "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason, "logprobs": seq.logprobs,
            "cumulative_logprob": seq.cumulative_logprob}


def request_output(seqs: list[Sequence], tokenizer) -> RequestOutput:
    """The output dict of a finished request: the first completion at the top level, all in "outputs"."""
    leader = seqs[0]
    completions = [_completion(seq, tokenizer) for seq in seqs]
    first = {k: v for k, v in completions[0].items() if k != "index"}
    return {**first, "prompt_token_ids": leader.token_ids[:leader.num_prompt_tokens],
            "prompt_logprobs": leader.prompt_logprobs, "num_cached_tokens": leader.num_cached_tokens,
            "outputs": completions}
