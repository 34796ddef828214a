"""OpenAI response bodies for one HTTP request: the full completion (a choice per prompt and
completion), and the server-sent-event chunks of a streamed one (text_completion or
chat.completion.chunk), each as `data: {json}\\n\\n`; logprobs in OpenAI's two shapes (the legacy
completions one, and chat's `content` list). The chunks in mid-stream of the common case (choice 0, no
logprobs), one per stream per step, are filled into a template made once per request: only their text
and token ids are encoded each time."""

import json

from nanovllm.serve.protocol import RequestError, now

# Stands in for a chunk's text while its template is made: JSON escapes NUL, so the encoded
# marker cannot occur anywhere else in the event.
_TEXT_SLOT = "\0text\0"
# How every chunk event ends: the choice, the choices list and the body close.
_CLOSE = "}]}\n\n"
# A logprob of -inf (a token the sampler masked) has no JSON spelling; vLLM sends this instead.
MIN_LOGPROB = -9999.0


def check_finished(output: dict, error: str | None = None) -> None:
    """Raise the RequestError that an aborted or failed request answers with; `error`: why the
    server aborted it, if it did."""
    if output["finish_reason"] == "abort":
        raise RequestError(error or output.get("error", "the request was aborted"), status=503,
                           kind="server_error")
    if output["finish_reason"] == "error" and output.get("refused"):  # the request's fault: a 400
        raise RequestError(output["error"])
    if output["finish_reason"] == "error":
        raise RequestError(f"the request failed in the engine: {output['error']}", status=500,
                           kind="server_error")


def tool_finish_reason(finish_reason: str, has_calls: bool) -> str:
    """OpenAI's "tool_calls" for a reply that ends in calls (not one cut short: "length" stays)."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def completions_of(output: dict) -> list[dict]:
    """Every completion of a finished request (an output the engine process made up for a refused
    request has only the top-level one)."""
    return output.get("outputs") or [{"index": 0, **{k: output.get(k) for k in (
        "text", "token_ids", "finish_reason", "stop_reason", "logprobs")}}]


class LogprobsFormatter:
    """Turns the engine's per-token {token id: logprob} dicts into OpenAI's logprobs objects."""

    def __init__(self, tokenizer, is_chat: bool, num_top: int) -> None:
        self.tokenizer, self.is_chat, self.num_top = tokenizer, is_chat, num_top

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling without a tokenizer
        return self.tokenizer.decode([token_id])

    def _top(self, logprobs: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(logprobs.items(), key=lambda item: -item[1])[:self.num_top]

    def format(self, token_ids: list[int], logprobs: list[dict[int, float] | None],
               text_offset: int = 0) -> dict:
        if self.is_chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs)]}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, logprob in zip(token_ids, logprobs):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if logprob is None:  # the first prompt token has none
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(max(logprob.get(token_id, MIN_LOGPROB), MIN_LOGPROB))
            top_logprobs.append({self.token_text(t): max(v, MIN_LOGPROB) for t, v in self._top(logprob)})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprobs: dict[int, float]) -> dict:
        def entry(t: int, value: float) -> dict:
            text = self.token_text(t)
            return {"token": text, "logprob": max(value, MIN_LOGPROB), "bytes": list(text.encode())}
        return {**entry(token_id, logprobs.get(token_id, MIN_LOGPROB)),
                "top_logprobs": [entry(t, v) for t, v in self._top(logprobs)]}


class Reply:
    def __init__(self, kind: str, request_id: str, model_name: str) -> None:
        assert kind in ("text_completion", "chat.completion"), f"unknown reply kind {kind}"
        self.is_chat = kind == "chat.completion"
        self.kind, self.id, self.model, self.created = kind, request_id, model_name, now()
        self.chunk_kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        # A mid-stream chunk is head + json(text) + middle [+ ', "token_ids": [...]'] + _CLOSE.
        head, tail = self._chunk_event(_TEXT_SLOT, None, None).split(json.dumps(_TEXT_SLOT))
        assert tail.endswith(_CLOSE), f"a chunk event ends {tail[-8:]!r}, not {_CLOSE!r}"
        self._head, self._middle = head, tail[:-len(_CLOSE)]

    def _body(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def choice(self, index: int, text: str | None, finish_reason: str, logprobs: dict | None = None,
               stop_reason: int | str | None = None, tool_calls: list[dict] | None = None) -> dict:
        content = {"message": {"role": "assistant", "content": text}} if self.is_chat else {"text": text}
        if tool_calls:
            content["message"]["tool_calls"] = tool_calls
            finish_reason = tool_finish_reason(finish_reason, True)
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def full(self, choices: list[dict], usage: dict) -> dict:
        return {**self._body(self.kind, choices), "usage": usage}

    def _event(self, body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def first_chunk(self, index: int = 0) -> str:
        """Chat streams open with the assistant's role; completion streams send nothing first."""
        if not self.is_chat:
            return ""
        return self._event(self._body(self.chunk_kind, [{
            "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]))

    def chunk(self, text: str, token_ids: list[int] | None, finish_reason: str | None = None,
              index: int = 0, logprobs: dict | None = None, usage: dict | None = None) -> str:
        """One event: a delta of text (and, when given, its token ids and logprobs), or the last one's
        finish reason."""
        if finish_reason is not None or index or logprobs is not None or usage is not None:
            return self._chunk_event(text, token_ids, finish_reason, index, logprobs, usage)
        ids = "" if token_ids is None else f', "token_ids": [{", ".join(map(str, token_ids))}]'
        return f"{self._head}{json.dumps(text, ensure_ascii=False)}{self._middle}{ids}{_CLOSE}"

    def _chunk_event(self, text: str, token_ids: list[int] | None, finish_reason: str | None,
                     index: int = 0, logprobs: dict | None = None, usage: dict | None = None) -> str:
        if self.is_chat:
            choice = {"index": index, "delta": {"content": text} if text or finish_reason is None else {},
                      "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = self._body(self.chunk_kind, [choice])
        if usage is not None:
            body["usage"] = usage
        return self._event(body)

    def tool_calls_chunk(self, calls: list[dict], first: int, index: int = 0) -> str:
        """One event with whole tool calls, numbered from `first` within their choice."""
        deltas = [{"index": first + i, **call} for i, call in enumerate(calls)]
        return self._event(self._body(self.chunk_kind, [{
            "index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}]))

    def usage_chunk(self, usage: dict) -> str:
        return self._event({**self._body(self.chunk_kind, []), "usage": usage})
