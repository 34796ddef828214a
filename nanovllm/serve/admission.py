"""What the HTTP process checks before a request goes to an engine process: the engine's own checks
(nanovllm.engine.validation) against its context length and KV cache, so that bad input is a 400 with
the engine's message and never reaches it; and the chat template."""

import itertools

from nanovllm.config import Config
from nanovllm.engine.validation import Prompt, check_request
from nanovllm.serve.protocol import RequestError
from nanovllm.serve.request_stream import ServerRequest
from nanovllm.utils.tokenizer import chat_token_ids


class Admission:
    def __init__(self, config: Config, tokenizer, num_kvcache_blocks: int) -> None:
        self.config, self.tokenizer, self.num_kvcache_blocks = config, tokenizer, num_kvcache_blocks
        self._request_ids = itertools.count()

    def make_request(self, prompt: Prompt, req) -> ServerRequest:
        """Tokenize and check a completion or chat request (protocol.py); max_tokens defaults to what
        the context and the cache leave."""
        config = self.config
        try:
            token_ids, _ = check_request(config, self.num_kvcache_blocks, self.tokenizer, prompt,
                                         req.sampling_params(max_tokens=1))
            capacity = self.num_kvcache_blocks * config.kvcache_block_size
            room = min(config.max_model_len, capacity) - len(token_ids)
            max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or max(room, 1)
            _, params = check_request(config, self.num_kvcache_blocks, self.tokenizer, token_ids,
                                      req.sampling_params(max_tokens))
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from e
        return ServerRequest(next(self._request_ids), token_ids, params)

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer, but the server runs with --skip-tokenizer-init")
        try:
            return chat_token_ids(self.tokenizer, messages, add_generation_prompt)
        except Exception as e:  # a template may reject any conversation it does not expect
            raise RequestError(f"the chat template rejected the messages: {e}", "messages") from e
