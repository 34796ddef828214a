"""Decides when a sequence is finished after a new token: EOS (unless ignore_eos), stop_token_ids,
stop strings (the completion text is cut before the stop string, or after it with
include_stop_str_in_output), max_tokens and max_model_len. Before min_tokens tokens, EOS, stop ids and
stop strings do not end a sequence (as vLLM). Records `seq.stop_reason`: the stop token id or stop
string that ended it (None for EOS and length). `eos_token_ids` gathers a model's end tokens."""

from transformers import GenerationConfig

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.hf_options import HF_LOCAL_ONLY

# A stop string ends inside the text of the last few tokens; decode this many extra tokens beyond its
# length in characters, since a token can carry less than one character (byte-fallback pieces).
STOP_WINDOW_SLACK = 8


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
        """Return "stop" or "length" if seq is finished after its last token, else None."""
        params, token_ids = seq.sampling_params, seq.token_ids
        token, num_tokens = token_ids[-1], len(token_ids)
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
