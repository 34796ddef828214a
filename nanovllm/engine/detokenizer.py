"""Incremental detokenization for streaming: turns a request's growing list of completion token ids
into text deltas. A delta never ends inside a multi-byte character (a byte-level token can carry
part of one: the decoder then shows U+FFFD, and the text waits for the next token), and the deltas
join to exactly the request's final text, stop strings included: while a stop string could still
be completing, the last characters are held back, since the final text is cut before it. Pure
Python; the tokenizer is anything with `decode(ids, skip_special_tokens=...)`."""

REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for the bytes of an unfinished character


class IncrementalDetokenizer:
    """Feed the completion's new token ids with `push`; when the request finishes, `finish` with
    its final text returns the last delta."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        # Each decode covers only the tokens since `prefix_offset`, not the whole completion:
        # |-- done --|-- prefix (decoded last time) --|-- new tokens --|
        #            prefix_offset                    read_offset
        # The new text is decode(prefix + new) minus decode(prefix): the prefix gives the new tokens
        # their left context (a SentencePiece word-start space, a character's leading bytes).
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # the decoded text so far, whole characters only
        self.num_emitted = 0  # characters of `text` handed out as deltas
        # A stop string that is still completing may start this many characters before the end.
        self.holdback = max(map(len, stop), default=1) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def emitted_text(self) -> str:
        return self.text[:self.num_emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int]) -> str:
        """Add the newly generated tokens; returns the text that became final (maybe "")."""
        self.token_ids.extend(new_token_ids)
        if len(self.token_ids) > self.read_offset:
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        end = len(self.text) - self.holdback
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta

    def finish(self, final_text: str, new_token_ids: list[int] = ()) -> str:
        """The last delta, given the request's final text (which a stop string may have cut) and
        its tokens not pushed yet: the final text is the truth, so they need no decoding."""
        self.token_ids.extend(new_token_ids)
        emitted = self.emitted_text
        if not final_text.startswith(emitted):
            # Only a tokenizer whose windowed decode disagrees with its whole decode gets here;
            # what was sent cannot be taken back, so the stream ends as sent.
            return ""
        self.text, self.num_emitted = final_text, len(final_text)
        return final_text[len(emitted):]
