"""A request as the engine holds it: its n sequences (one per completion, all over the same prompt),
built from a validated SamplingParams; what each step adds to them (tokens, logprobs); when a sequence
stops (StopChecker); the RequestOutput made from them once all have finished (its logprobs ranked);
and the tracker that keeps that output until its caller takes it. Pure Python.

Stops: EOS (unless ignore_eos), stop_token_ids, stop strings (the completion text is cut before the stop
string, or after it with include_stop_str_in_output), max_tokens and max_model_len. Before min_tokens
tokens, EOS, stop ids and stop strings do not end a sequence (as vLLM). `seq.stop_reason` records the
stop token id or stop string that ended it (None for EOS and length). A structured output's grammar
(engine/structured_outputs.py) advances with each token here, and ends the sequence once complete.

n > 1: completion i samples with seed + i (reproducible and distinct), and completions 1..n-1 wait
for completion 0 (their leader) to compute the prompt, then find its KV blocks in the prefix cache.
Only the leader computes prompt logprobs (which keeps it off the prefix cache)."""

import logging
from collections.abc import Container

from transformers import GenerationConfig

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step import StepOutput
from nanovllm.engine.structured_outputs import grammar_matcher
from nanovllm.outputs import FIRST_COMPLETION_KEYS, CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.hf_options import HF_LOCAL_ONLY

# A stop string ends inside the text of the last few tokens; decode this many extra tokens beyond its
# length in characters, since a token can carry less than one character (byte-fallback pieces).
STOP_WINDOW_SLACK = 8

logger = logging.getLogger("nanovllm")


def eos_token_ids(config: Config, tokenizer) -> tuple[int, ...]:
    """The model's end tokens: its config's, its generation_config.json's and its tokenizer's."""
    ids = set(config.eos_token_ids)
    # generation_config.json often lists extra end tokens (e.g. a chat model's end-of-turn). A GGUF
    # file carries its end tokens in its own metadata, already in the config; the folder around it
    # may hold another model's generation_config.json, so it is not read.
    if config.gguf_path is None:
        try:
            eos = GenerationConfig.from_pretrained(config.model, **HF_LOCAL_ONLY).eos_token_id
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        except OSError:
            pass
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def decode_options(seq: Sequence) -> dict:
    """The tokenizer.decode arguments a request asked for."""
    params = seq.sampling_params
    return {"skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens}


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer=None) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, seq: Sequence) -> str | None:
        """Return "stop" or "length" if seq is finished after its last token, else None. Its grammar
        matcher (structured outputs) accepts the token first: once the grammar is complete (it accepted
        an EOS, the only token its bitmask allows there), the sequence stops, whatever ignore_eos."""
        params, token_ids = seq.sampling_params, seq.token_ids
        token, num_tokens = token_ids[-1], len(token_ids)
        if seq.grammar is not None and self._grammar_ends(seq, token):
            return "stop"
        num_completion_tokens = num_tokens - seq.num_prompt_tokens
        # min_tokens=k: the first k tokens never stop it (the runner also masks EOS and stop ids there).
        if num_completion_tokens > params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if params.stop and self._hit_stop_string(seq):
                return "stop"
        if num_completion_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _grammar_ends(seq: Sequence, token: int) -> bool:
        """Advance seq's matcher by its new token; True when the grammar is complete, or when the token
        is one it cannot take: a row whose every token was masked (min_tokens banning the EOS the
        grammar requires) samples an arbitrary one, and the output ends there, as it can go no further."""
        if not seq.grammar.accept_token(token):
            logger.warning("sequence %d: token %d does not fit its structured output's grammar (its "
                           "other constraints left no token the grammar allows); stopping it", seq.seq_id,
                           token)
            return True
        return seq.grammar.is_terminated()

    def _hit_stop_string(self, seq: Sequence) -> bool:
        params = seq.sampling_params
        stops, options = params.stop, decode_options(seq)
        window = max(map(len, stops)) + STOP_WINDOW_SLACK
        # Decoded as the output text is (the request's decode options), so that the cut text is a
        # prefix of what a stream has already sent.
        tail = self.tokenizer.decode(seq.completion_token_ids[-window:], **options)
        if not any(s in tail for s in stops):
            return False
        text = self.tokenizer.decode(seq.completion_token_ids, **options)
        hits = [(i, s) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
        if not hits:  # the tail decoded differently in isolation; trust the full text
            return False
        cut, stop = min(hits, key=lambda hit: hit[0])
        seq.stop_reason = stop
        seq.stop_text = text[:cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
        return True


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
                   eos_token_ids: tuple[int, ...], tokenizer, grammar: object | None = None
                   ) -> list[Sequence]:
    """The n sequences of one request (params already validated); grammar: its compiled structured
    output constraint (GrammarCompiler.compile), of which each completion gets a matcher of its own."""
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
        if grammar is not None:
            seq.grammar = grammar_matcher(grammar)
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


def _ranked(entry: dict[int, float], k: int, tokenizer) -> dict[int, Logprob]:
    """One position's {token: logprob} (the chosen token first, carrying its rank from the device, then
    the top k in descending order, as layers/logprobs.py builds it) as Logprobs with their ranks and
    lazily decoded text: the top k's ranks follow from their order."""
    (token, logprob), *top = entry.items()
    chosen_rank = getattr(logprob, "rank", None)
    if chosen_rank is None and len(entry) <= k:  # among the top k: its rank follows from theirs
        chosen_rank = sum(value > logprob for _, value in top) + 1
    above = sum(value > logprob for _, value in top)
    out = {token: Logprob(logprob, chosen_rank, None, token, tokenizer)}
    for i, (other, value) in enumerate(top):
        out[other] = Logprob(value, i + 1 if i < above else i + 2, None, other, tokenizer)
    return out


def _logprobs(entries: list | None, k: int | None, tokenizer) -> list | None:
    if entries is None:
        return None
    return [None if entry is None else _ranked(entry, k, tokenizer) for entry in entries]


def _completion(seq: Sequence, tokenizer) -> CompletionOutput:
    params = seq.sampling_params
    if not params.detokenize or tokenizer is None:
        text, tokenizer = "", None  # no text, and no decoded_token in the logprobs either
    elif seq.stop_text is not None:
        text = seq.stop_text
    else:
        text = tokenizer.decode(seq.completion_token_ids, **decode_options(seq))
    return CompletionOutput(index=seq.completion_index, text=text, token_ids=seq.completion_token_ids,
                            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                            logprobs=_logprobs(seq.logprobs, params.logprobs, tokenizer),
                            cumulative_logprob=seq.cumulative_logprob)


def request_output(seqs: list[Sequence], tokenizer) -> RequestOutput:
    """The output of a finished request: the first completion at the top level, all in "outputs"."""
    leader = seqs[0]
    completions = [_completion(seq, tokenizer) for seq in seqs]
    first = completions[0]
    params = leader.sampling_params
    prompt_tokenizer = tokenizer if params.detokenize else None
    return RequestOutput(
        {key: first[key] for key in FIRST_COMPLETION_KEYS}, request_id=request_id_of(leader),
        prompt_token_ids=leader.token_ids[:leader.num_prompt_tokens],
        prompt_logprobs=_logprobs(leader.prompt_logprobs, params.prompt_logprobs, prompt_tokenizer),
        num_cached_tokens=leader.num_cached_tokens, outputs=completions,
        metrics=RequestMetrics(num_drafts=sum(seq.num_drafts for seq in seqs),
                               num_draft_tokens=sum(seq.num_draft_tokens for seq in seqs),
                               num_accepted_tokens=sum(seq.num_accepted_tokens for seq in seqs)))


def request_id_of(seq: Sequence) -> int:
    """The id of the request seq belongs to: its leader's seq_id (its own for completion 0)."""
    return (seq.leader or seq).seq_id


class RequestTracker:
    """Whose output is whose. Several callers may drive one engine, each from its own thread (generate,
    stream, the server's loop): whichever thread runs a step, every finished output waits here until
    a caller takes it by id, so none is dropped or handed to the wrong caller. The engine's lock
    guards it."""

    def __init__(self) -> None:
        self.live: dict[int, list[Sequence]] = {}  # request id -> its sequences, until it ends
        self.done: dict[int, RequestOutput] = {}  # finished outputs, until a caller takes them

    def add(self, seqs: list[Sequence]) -> int:
        request_id = seqs[0].seq_id
        assert request_id not in self.live, f"request {request_id} queued twice"
        self.live[request_id] = seqs
        return request_id

    def finish(self, request_id: int, output: RequestOutput) -> None:
        self.live.pop(request_id)
        self.done[request_id] = output

    def take_done(self, request_ids: Container[int]) -> list[tuple[int, RequestOutput]]:
        """(id, output) of the finished requests among request_ids, each taken once. Its cost is the
        outputs finished and not yet taken, not the size of request_ids: a caller that asks after
        every step for the few of its many requests that finished pays for those few."""
        ready = [request_id for request_id in self.done if request_id in request_ids]
        return [(request_id, self.done.pop(request_id)) for request_id in ready]
