"""Decides when a sequence is finished after a new token: EOS (unless ignore_eos), stop_token_ids,
stop strings (the completion text is cut before the stop string), max_tokens and max_model_len."""

from nanovllm.engine.sequence import Sequence

# A stop string ends inside the text of the last few tokens; decode this many extra tokens beyond its
# length in characters, since a token can carry less than one character (byte-fallback pieces).
STOP_WINDOW_SLACK = 8


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer=None) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, seq: Sequence) -> str | None:
        """Return "stop" or "length" if seq is finished after its last token, else None."""
        params, token = seq.sampling_params, seq.token_ids[-1]
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self._hit_stop_string(seq):
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        stops = seq.sampling_params.stop
        window = max(map(len, stops)) + STOP_WINDOW_SLACK
        # Decoded as the output text is (special tokens skipped), so that the cut text is a prefix
        # of what a stream has already sent.
        tail = self.tokenizer.decode(seq.completion_token_ids[-window:], skip_special_tokens=True)
        if not any(s in tail for s in stops):
            return False
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut < 0:  # the tail decoded differently in isolation; trust the full text
            return False
        seq.stop_text = text[:cut]
        return True
