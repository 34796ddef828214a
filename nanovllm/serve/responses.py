"""OpenAI response bodies for one request: the full completion, and the server-sent-event chunks
of a streamed one (text_completion or chat.completion.chunk), each as `data: {json}\\n\\n`. The
chunks in mid-stream, one per stream per step, are filled into a template made once per request:
only their text and token ids are encoded each time."""

import json

from nanovllm.serve.protocol import RequestError, now

# Stands in for a chunk's text while its template is made: JSON escapes NUL, so the encoded
# marker cannot occur anywhere else in the event.
_TEXT_SLOT = "\0text\0"
# How every chunk event ends: the choice, the choices list and the body close.
_CLOSE = "}]}\n\n"


def check_finished(output: dict) -> None:
    """Raise the RequestError that an aborted or failed request answers with."""
    if output["finish_reason"] == "abort":
        raise RequestError(output.get("error", "the request was aborted"), status=503, kind="server_error")
    if output["finish_reason"] == "error":
        raise RequestError(f"the request failed in the engine: {output['error']}", status=500,
                           kind="server_error")


class Reply:
    def __init__(self, kind: str, request_id: str, model_name: str) -> None:
        assert kind in ("text_completion", "chat.completion"), f"unknown reply kind {kind}"
        self.is_chat = kind == "chat.completion"
        self.kind, self.id, self.model, self.created = kind, request_id, model_name, now()
        # A mid-stream chunk is head + json(text) + middle [+ ', "token_ids": [...]'] + _CLOSE.
        head, tail = self._chunk_event(_TEXT_SLOT, None, None).split(json.dumps(_TEXT_SLOT))
        assert tail.endswith(_CLOSE), f"a chunk event ends {tail[-8:]!r}, not {_CLOSE!r}"
        self._head, self._middle = head, tail[:-len(_CLOSE)]

    def _body(self, obj: str, choice: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    def full(self, text: str, finish_reason: str) -> dict:
        content = {"message": {"role": "assistant", "content": text}} if self.is_chat else {"text": text}
        return self._body(self.kind, {"index": 0, **content, "logprobs": None,
                                      "finish_reason": finish_reason})

    def _event(self, body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def first_chunk(self) -> str:
        """Chat streams open with the assistant's role; completion streams send nothing first."""
        if not self.is_chat:
            return ""
        return self._event(self._body("chat.completion.chunk", {
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}))

    def chunk(self, text: str, token_ids: list[int] | None, finish_reason: str | None = None) -> str:
        """One event: a delta of text (and, when given, its token ids), or the last one's finish reason."""
        if finish_reason is not None:
            return self._chunk_event(text, token_ids, finish_reason)
        ids = "" if token_ids is None else f', "token_ids": [{", ".join(map(str, token_ids))}]'
        return f"{self._head}{json.dumps(text, ensure_ascii=False)}{self._middle}{ids}{_CLOSE}"

    def _chunk_event(self, text: str, token_ids: list[int] | None, finish_reason: str | None) -> str:
        if self.is_chat:
            choice = {"index": 0, "delta": {"content": text} if text or finish_reason is None else {},
                      "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return self._event(self._body(obj, choice))

    def usage_chunk(self, usage: dict) -> str:
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        return self._event({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                            "choices": [], "usage": usage})
