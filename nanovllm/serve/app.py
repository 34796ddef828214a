"""The OpenAI-compatible HTTP app (FastAPI): /v1/models (and /v1/models/{id}), /v1/completions,
/v1/chat/completions (streamed as server-sent events in OpenAI's chunk format, ending in
`data: [DONE]`), vLLM's /tokenize and /detokenize, /version, /health and /metrics. Bad input is a 400
with OpenAI's error object (and a log line saying why) and never reaches the engine process; a body
over `max_request_bytes` is a 413 before it is parsed; a wrong or missing key is a 401 when the server
has one; a client that goes away, streaming or not, has its requests aborted at once. Parsing,
templating and tokenizing run in a tokenizer process (admission.py): the event loop only moves bytes.
A chat request with tools has each completion's text passed through a tool-call stream (tool_calls.py)
that turns it into `content` and `tool_calls`, streamed or not."""

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from nanovllm.serve.admission import MAX_REQUEST_BYTES, Admission
from nanovllm.serve.engine_client import EngineClient
from nanovllm.serve.metrics import log_stats_forever, make_registry
from nanovllm.serve.protocol import (
    RequestError,
    error_body,
    new_id,
    now,
    usage,
)
from nanovllm.serve.request_stream import RequestStream, ServerRequest
from nanovllm.serve.responses import LogprobsFormatter, Reply, check_finished, completions_of
from nanovllm.serve.streaming import sse_events, sse_events_general
from nanovllm.serve.tool_calls import TOOL_PARSERS, extract_tool_calls, tool_call_stream

logger = logging.getLogger(__name__)

# After uvicorn's graceful shutdown, the engine gets this long to abort what is left and shut down.
ENGINE_STOP_TIMEOUT_S = 30.0
# The log's throughput line comes this often while there is work.
LOG_STATS_INTERVAL_S = 5.0


def package_version() -> str:
    try:
        return version("nanovllm")
    except PackageNotFoundError:
        return "unknown"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to be over `limit` bytes."""
    declared = request.headers.get("content-length", "")
    too_large = RequestError(f"the request body is over the server's limit of {limit} bytes "
                             "(--max-request-bytes)", status=413, code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_disconnected(request: Request) -> None:
    """Return when the client closes its connection (its body was read already, so the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              stream_interval: int = 1, max_request_bytes: int = MAX_REQUEST_BYTES,
              log_stats: bool = True, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False) -> FastAPI:
    """engine: started (its processes ready). stream_interval: a streamed response sends a chunk
    every this-many tokens (1: each token). tool_call_parser (tool_calls.TOOL_PARSERS' names) with
    enable_auto_tool_choice: tool_choice "auto" is served, parsing calls in that format."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {tool_call_parser!r}; valid: {sorted(TOOL_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser to find the calls in the output")
    if not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval must be a positive integer, got {stream_interval!r}")
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    admission = Admission(engine.config, engine.tokenizer, engine.num_kvcache_blocks, model_name,
                          enable_auto_tool_choice)
    admission.start()
    registry = make_registry(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        logger_task = asyncio.ensure_future(log_stats_forever(engine, LOG_STATS_INTERVAL_S)) if log_stats \
            else None
        yield
        if logger_task is not None:
            logger_task.cancel()
        # uvicorn has drained the connections it could; abort the rest
        await engine.stop(ENGINE_STOP_TIMEOUT_S)
        admission.close()

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    app.state.engine = engine

    async def check_api_key(request: Request) -> None:
        if api_key is not None:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
                raise RequestError("invalid or missing API key: send 'Authorization: Bearer KEY'",
                                   status=401, code="invalid_api_key")

    # A dependency, not an HTTP middleware: starlette's BaseHTTPMiddleware relays every chunk of a
    # streamed response through a memory channel and a second task; without it the server streamed
    # 2,955 against 1,690 tokens a second at 256 streams on a CPU (docs/performance-notes.md, "Server",
    # 2026-11-30, f8d84e8).
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    # vLLM's tokenizer endpoints, at the root as there, and behind the key: they cost tokenizer time.
    tokenizer_routes = APIRouter(dependencies=[Depends(check_api_key)])

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        logger.info("%s %s: %d %s", request.method, request.url.path, e.status, e)
        return JSONResponse(error_body(str(e), e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            why = f"the engine failed: {engine.error}" if engine.error else "the engine is not running"
            return JSONResponse(error_body(why, "server_error"), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def server_version():
        return {"version": package_version()}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": now(), "owned_by": "nanovllm",
                "root": model_name, "max_model_len": engine.config.max_model_len}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    def check_model(name: str | None) -> None:
        admission.check_model(name)

    # ---- routes ----
    @tokenizer_routes.post("/tokenize")
    async def tokenize_route(request: Request):
        return await admission.run("tokenize", await read_body(request, max_request_bytes))

    @tokenizer_routes.post("/detokenize")
    async def detokenize_route(request: Request):
        return await admission.run("detokenize", await read_body(request, max_request_bytes))

    @v1.post("/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        body = await read_body(request, max_request_bytes)
        req, server_requests = await admission.run("prepare_completion", body, arrival)
        return await respond(request, req, server_requests,
                             Reply("text_completion", new_id("cmpl"), model_name))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        body = await read_body(request, max_request_bytes)
        req, server_requests = await admission.run("prepare_chat", body, arrival)
        return await respond(request, req, server_requests,
                             Reply("chat.completion", new_id("chatcmpl"), model_name))

    async def respond(request: Request, req, server_requests: list[ServerRequest], reply: Reply):
        streams = []
        try:
            for server_request in server_requests:
                streams.append(engine.submit(server_request))
        except RuntimeError as e:
            for stream in streams:
                engine.abort(stream.request.request_id)
            raise RequestError(str(e), status=503, kind="server_error") from e
        with_token_ids = req.return_token_ids or engine.tokenizer is None
        mode = getattr(req, "tool_mode", None)
        tool_calls = None if mode is None else (lambda: tool_call_stream(mode, tool_call_parser))
        if not req.stream:
            return await collect(request, req, streams, reply, with_token_ids, tool_calls)
        options = req.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options.continuous_usage_stats
        first = streams[0].request
        if (len(streams) == 1 and not first.detailed and first.prompt_text is None and not continuous_usage
                and tool_calls is None):
            events = sse_events(engine, streams[0], reply, engine.tokenizer, with_token_ids, include_usage,
                                stream_interval)
        else:
            events = sse_events_general(engine, streams, reply, engine.tokenizer, with_token_ids,
                                        include_usage, continuous_usage, tool_calls)
        return StreamingResponse(events, media_type="text/event-stream")

    async def collect(request: Request, req, streams: list[RequestStream], reply: Reply,
                      with_token_ids: bool, tool_calls):
        results = asyncio.ensure_future(asyncio.gather(*(stream.result() for stream in streams)))
        left = asyncio.ensure_future(wait_disconnected(request))
        try:
            await asyncio.wait({results, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not results.done():  # the client left (or the server is stopping): abort its requests
                results.cancel()
                for stream in streams:
                    engine.abort(stream.request.request_id)
        if results.cancelled() or not results.done():
            return Response(status_code=499)
        return full_body(req, streams, results.result(), reply, with_token_ids, tool_calls)

    def full_body(req, streams: list[RequestStream], outputs: list[dict], reply: Reply,
                  with_token_ids: bool, tool_calls) -> dict:
        """tool_calls: None, or a factory of the stream that finds one completion's tool calls."""
        num_logprobs = req.num_logprobs
        formatter = None if num_logprobs is None else LogprobsFormatter(engine.tokenizer, reply.is_chat,
                                                                        num_logprobs)
        choices, num_completion_tokens = [], 0
        for stream, output in zip(streams, outputs):
            check_finished(output, stream.error)
            request = stream.request
            prompt_text = request.prompt_text or ""
            for completion in completions_of(output):
                token_ids = completion["token_ids"]
                num_completion_tokens += len(token_ids)
                logprobs = None
                if formatter is not None:
                    ids, lps = token_ids, completion["logprobs"] or []
                    if request.prompt_text is not None and output.get("prompt_logprobs") is not None:
                        ids, lps = request.prompt_token_ids + ids, output["prompt_logprobs"] + lps
                    logprobs = formatter.format(ids, lps)
                text, calls = prompt_text + completion["text"], None
                if tool_calls is not None:
                    text, calls = extract_tool_calls(tool_calls(), text)
                choice = reply.choice(request.index * request.sampling_params.n + completion["index"],
                                      text, completion["finish_reason"], logprobs,
                                      completion.get("stop_reason"), calls)
                if with_token_ids:
                    choice["token_ids"] = token_ids
                    choice["prompt_token_ids"] = request.prompt_token_ids
                if req.prompt_logprobs is not None and output.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = [None if lp is None else {str(t): v for t, v in lp.items()}
                                                 for lp in output["prompt_logprobs"]]
                choices.append(choice)
        num_prompt_tokens = sum(stream.request.num_prompt_tokens for stream in streams)
        return reply.full(choices, usage(num_prompt_tokens, num_completion_tokens))

    app.include_router(v1)
    app.include_router(tokenizer_routes)
    return app

