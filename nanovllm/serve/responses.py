"""OpenAI response bodies for one request: the full completion, and the server-sent-event chunks
of a streamed one (text_completion or chat.completion.chunk), each as `data: {json}\\n\\n`."""

import json

from nanovllm.serve.protocol import now


class Reply:
    def __init__(self, kind: str, request_id: str, model_name: str) -> None:
        assert kind in ("text_completion", "chat.completion"), f"unknown reply kind {kind}"
        self.is_chat = kind == "chat.completion"
        self.kind, self.id, self.model, self.created = kind, request_id, model_name, now()

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
