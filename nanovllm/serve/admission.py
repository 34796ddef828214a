"""What the HTTP process checks before a request goes to an engine process: the engine's own checks
(nanovllm.engine.validation) against its context length and KV cache, so that bad input is a 400 with
the engine's message and never reaches it; the chat template (with the request's tools); and an output
constraint, compiled here too (a bad one is a 400 before anything is sent: a stream's 200 would go out
before the engine process could refuse it). All of it (parsing the body,
templating, tokenizing) runs in a tokenizer process of its own, never on the event loop: a prompt of
megabytes takes seconds to tokenize. A thread is not enough: the tokenizer holds the GIL for tens of
milliseconds at a time, and beside a running stream /health then stalled for up to a second (2 cores);
a process costs a pickled copy of the token ids (a few ms per million). One process, as vLLM's one
tokenizer thread: a large prompt delays only the requests that arrive behind it."""

import asyncio
import itertools
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor

from pydantic import BaseModel, ValidationError

from nanovllm.config import Config
from nanovllm.engine.requests import eos_token_ids
from nanovllm.engine.structured_outputs import GrammarCompiler
from nanovllm.engine.validation import Prompt, check_request, tokenize_prompt
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    describe_validation_error,
)
from nanovllm.serve.request_stream import ServerRequest
from nanovllm.serve.tool_calls import tool_constraint
from nanovllm.utils.parent_watch import exit_with_parent
from nanovllm.utils.tokenizer import chat_token_ids, load_engine_tokenizer

# The largest request body (a 413 past it): 4x the JSON of a 128K-token prompt sent as token ids
# (~7 bytes a token), beyond any prompt a context holds, and small enough to tokenize in seconds.
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as e:
        raise describe_validation_error(e) from None


_worker: "Admission | None" = None  # the tokenizer process's own


# The tokenizer process's name in ps and /proc/PID/comm, so that tools tell it from the engine processes.
TOKENIZER_PROCESS_NAME = b"nanovllm-tokenz"  # comm holds 15 bytes


def _start_worker(config: Config, num_kvcache_blocks: int, model_name: str, auto_tool_choice: bool) -> None:
    global _worker
    # Ctrl-C reaches the whole process group: stopping is the HTTP process's call. A killed server must
    # not leave its tokenizer behind.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent("tokenizer process")
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, TOKENIZER_PROCESS_NAME, 0, 0, 0)  # PR_SET_NAME (Linux)
    except (OSError, AttributeError):
        pass
    _worker = Admission(config, load_engine_tokenizer(config), num_kvcache_blocks, model_name,
                        auto_tool_choice)


def _call(method: str, *args):
    return getattr(_worker, method)(*args)


class Admission:
    def __init__(self, config: Config, tokenizer, num_kvcache_blocks: int, model_name: str | None = None,
                 auto_tool_choice: bool = False) -> None:
        self.config, self.tokenizer, self.num_kvcache_blocks = config, tokenizer, num_kvcache_blocks
        self.model_name = model_name
        self.auto_tool_choice = auto_tool_choice  # --enable-auto-tool-choice (with a --tool-call-parser)
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        # Request ids are the HTTP process's: the tokenizer process's requests are numbered there.
        self._request_ids = itertools.count()
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the tokenizer process and wait until it has loaded the tokenizer."""
        self._pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _start_worker,
                                         (self.config, self.num_kvcache_blocks, self.model_name,
                                          self.auto_tool_choice))
        self._pool.submit(int).result()  # a process pool starts its process at the first task

    async def run(self, method: str, *args):
        """self.method(*args) in the tokenizer process; a ServerRequest gets its id here."""
        result = await asyncio.get_running_loop().run_in_executor(self._pool, _call, method, *args)
        if isinstance(result, tuple):
            for request in result[1]:
                request.request_id = next(self._request_ids)
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- in the tokenizer process ----
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise RequestError(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                               "model", status=404, code="model_not_found")

    def prepare_completion(self, body: bytes, arrival: float):
        req = parse(CompletionRequest, body)
        self.check_model(req.model)
        return req, self.completion_requests(req, arrival)

    def prepare_chat(self, body: bytes, arrival: float):
        req = parse(ChatCompletionRequest, body)
        self.check_model(req.model)
        return req, [self.chat_request(req, arrival)]

    def tokenize(self, body: bytes) -> dict:
        req = parse(TokenizeRequest, body)
        self.check_model(req.model)
        if self.tokenizer is None:
            raise RequestError("/tokenize needs a tokenizer, but the server runs with --skip-tokenizer-init")
        if req.messages is not None:
            tokens = self.chat_prompt_ids(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        else:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens}

    def detokenize(self, body: bytes) -> dict:
        req = parse(DetokenizeRequest, body)
        self.check_model(req.model)
        vocab_size = self.config.hf_config.vocab_size
        if any(not 0 <= t < vocab_size for t in req.tokens):
            raise RequestError(f"token ids must be in [0, {vocab_size})", "tokens")
        return {"prompt": self.decode(req.tokens)}

    def completion_requests(self, req: CompletionRequest, arrival: float) -> list[ServerRequest]:
        constraint = req.constraint()
        return [self.make_request(prompt, req, arrival, index, constraint)
                for index, prompt in enumerate(req.prompts())]

    def chat_request(self, req: ChatCompletionRequest, arrival: float) -> ServerRequest:
        constraint, mode, template_kwargs = req.constraint(), req.tool_mode, req.chat_template_kwargs
        if mode is not None:
            if mode == "auto" and not self.auto_tool_choice:
                raise RequestError('tool_choice "auto" (the default with tools) needs the server started '
                                   "with --enable-auto-tool-choice and --tool-call-parser; send tool_choice "
                                   '"required", a named function or "none"', "tool_choice")
            tools_constraint = tool_constraint(req.tools, mode, req.parallel_tool_calls is not False)
            if tools_constraint is not None and constraint is not None:
                raise RequestError(f"tool_choice {mode!r} constrains the output to a tool call; it cannot "
                                   "be combined with response_format or another output constraint",
                                   "tool_choice")
            constraint = constraint or tools_constraint
            tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        token_ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, template_kwargs)
        return self.make_request(token_ids, req, arrival, constraint=constraint)

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                        chat_template_kwargs: dict | None) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer, but the server runs with --skip-tokenizer-init")
        try:
            return chat_token_ids(self.tokenizer, [message.as_dict() for message in messages],
                                  add_generation_prompt, chat_template_kwargs)
        except RequestError:
            raise
        except Exception as e:  # a template may reject any conversation it does not expect
            raise RequestError(f"the chat template rejected the messages: {e}", "messages") from e

    def make_request(self, prompt: Prompt, req, arrival: float, index: int = 0,
                     constraint: StructuredOutputsParams | None = None) -> ServerRequest:
        """Tokenize and check one prompt of a completion or chat request (protocol.py); max_tokens
        defaults to what the context and the cache leave; `constraint` on the output is compiled
        (a constraint xgrammar rejects is a ValueError, hence a 400)."""
        config = self.config
        echo = getattr(req, "echo", False)
        try:
            token_ids = tokenize_prompt(prompt, self.tokenizer, config.hf_config.vocab_size)
            capacity = min(config.max_model_len, self.num_kvcache_blocks * config.kvcache_block_size)
            max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
            if max_tokens is None:
                room = capacity - len(token_ids)
                if room < 1:
                    limit = (f"max_model_len {config.max_model_len}" if capacity == config.max_model_len
                             else f"the KV cache's {capacity} tokens")
                    raise RequestError(f"the prompt has {len(token_ids)} tokens, which leaves no room for a "
                                       f"completion within {limit}; shorten the prompt", "prompt")
                max_tokens = room
            params = req.sampling_params(max_tokens, constraint)
            if echo and params.logprobs is not None and params.prompt_logprobs is None:
                params.prompt_logprobs = params.logprobs  # echoed prompt tokens get logprobs too
            token_ids, params = check_request(config, self.num_kvcache_blocks, self.tokenizer, token_ids,
                                              params)
            if constraint is not None:
                self.grammars().compile(constraint)
        except RequestError:
            raise
        except (TypeError, ValueError, ImportError) as e:
            raise RequestError(str(e)) from e
        prompt_text = None
        if echo:
            prompt_text = prompt if isinstance(prompt, str) else self.decode(token_ids)
        return ServerRequest(-1, token_ids, params, arrival, prompt_text, index)  # its id: run()

    def grammars(self) -> GrammarCompiler:
        """The engine's grammar compiler, as the engine process builds it (same vocabulary and EOS)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.config.hf_config.vocab_size,
                                             eos_token_ids(self.config, self.tokenizer))
        return self._grammars

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)
