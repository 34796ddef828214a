"""LLM.stream's iterator: one request's text as it is generated, in deltas that join to exactly the text
its output holds (a delta never splits a multi-byte character; while a stop string may be completing,
its characters are held back: engine/detokenizer.py). It steps the engine itself while it waits, so
several streams and generate calls in other threads share the batches."""

from typing import Protocol

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.outputs import RequestOutput


class Engine(Protocol):
    """What a stream calls of its engine (an LLMEngine or a DataParallelEngine)."""

    def step(self) -> object: ...

    def take_outputs(self, request_ids: set[int]) -> list[tuple[int, RequestOutput]]: ...

    def completion_token_ids(self, request_id: int, start: int = 0) -> list[int] | None: ...

    def abort_request(self, request_ids: int) -> bool: ...


class TextStream:
    """One request's text deltas. Its request is aborted if the stream is closed or collected before
    the request finished."""

    def __init__(self, engine: Engine, request_id: int, tokenizer, stop: list[str],
                 skip_special_tokens: bool) -> None:
        self.engine, self.request_id = engine, request_id
        self.detokenizer = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens)
        self.done = False

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        engine, detokenizer = self.engine, self.detokenizer
        try:
            while not self.done:
                finished = engine.take_outputs({self.request_id})
                if finished:  # its last tokens come with its output
                    self.done = True
                    output = finished[0][1]
                    if "error" in output:
                        raise RuntimeError(f"request {self.request_id} failed: {output['error']}")
                    new_token_ids = output["token_ids"][detokenizer.num_tokens:]
                    if delta := detokenizer.finish(output["text"], new_token_ids):
                        return delta
                    break
                new_token_ids = engine.completion_token_ids(self.request_id, detokenizer.num_tokens)
                if new_token_ids is None:  # another thread's step finished it just now
                    continue
                if delta := detokenizer.push(new_token_ids):
                    return delta
                engine.step()
        except BaseException:
            self.close()
            raise
        raise StopIteration

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort_request(self.request_id)
            self.engine.take_outputs({self.request_id})  # nobody will read it

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the engine may be gone already
            pass
