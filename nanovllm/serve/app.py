"""The OpenAI-compatible HTTP app (FastAPI): /v1/models, /v1/completions, /v1/chat/completions
(streamed as server-sent events in OpenAI's chunk format, ending in `data: [DONE]`), /health and
/metrics. Bad input is a 400 with OpenAI's error object and never reaches the engine process; a wrong
or missing key is a 401 when the server has one; a client that goes away has its request aborted."""

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from nanovllm.serve.admission import Admission
from nanovllm.serve.engine_client import EngineClient
from nanovllm.serve.metrics import make_registry
from nanovllm.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    describe_validation_error,
    error_body,
    new_id,
    now,
    usage,
)
from nanovllm.serve.request_stream import RequestStream, ServerRequest
from nanovllm.serve.responses import Reply, check_finished
from nanovllm.serve.streaming import sse_events

logger = logging.getLogger(__name__)

# A non-streaming handler checks this often whether its client is still there.
DISCONNECT_POLL_S = 1.0
# After uvicorn's graceful shutdown, the engine gets this long to abort what is left and shut down.
ENGINE_STOP_TIMEOUT_S = 30.0


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as e:
        raise describe_validation_error(e) from None


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              stream_interval: int = 1) -> FastAPI:
    """engine: started (its processes ready). stream_interval: a streamed response sends a chunk
    every this-many tokens (1: each token)."""
    if not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval must be a positive integer, got {stream_interval!r}")
    admission = Admission(engine.config, engine.tokenizer, engine.num_kvcache_blocks)
    registry = make_registry(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        yield
        # uvicorn has drained the connections it could; abort the rest
        await engine.stop(ENGINE_STOP_TIMEOUT_S)

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    app.state.engine = engine

    async def check_api_key(request: Request) -> None:
        if api_key is not None:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
                raise RequestError("invalid or missing API key: send 'Authorization: Bearer KEY'",
                                   status=401, code="invalid_api_key")

    # A dependency, not an HTTP middleware: starlette's BaseHTTPMiddleware relays every chunk of a
    # streamed response through a memory channel and a second task; without it the server streams
    # nearly twice the tokens per second at 256 streams on a CPU (BENCHMARKS.md).
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
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

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "nanovllm", "root": engine.config.model,
                                            "max_model_len": engine.config.max_model_len}]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise RequestError(f"the model {name!r} does not exist; this server serves {model_name!r}",
                               "model", status=404, code="model_not_found")

    @v1.post("/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        check_model(req.model)
        server_request = admission.make_request(req.single_prompt(), req)
        return await respond(request, req, server_request,
                             Reply("text_completion", new_id("cmpl"), model_name))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await request.body())
        check_model(req.model)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        token_ids = admission.chat_token_ids(messages, req.add_generation_prompt)
        server_request = admission.make_request(token_ids, req)
        return await respond(request, req, server_request,
                             Reply("chat.completion", new_id("chatcmpl"), model_name))

    async def respond(request: Request, req, server_request: ServerRequest, reply: Reply):
        try:
            stream = engine.submit(server_request)
        except RuntimeError as e:
            raise RequestError(str(e), status=503, kind="server_error") from e
        with_token_ids = req.return_token_ids or engine.tokenizer is None
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = sse_events(engine, stream, reply, engine.tokenizer, with_token_ids, include_usage,
                                stream_interval)
            return StreamingResponse(events, media_type="text/event-stream")
        return await collect(request, stream, reply, with_token_ids)

    async def collect(request: Request, stream: RequestStream, reply: Reply, with_token_ids: bool):
        output = None
        try:
            while output is None:
                try:
                    output = (await asyncio.wait_for(stream.next(), DISCONNECT_POLL_S)).output
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
        finally:
            if output is None:
                engine.abort(stream.request.request_id)
        check_finished(output)
        body = reply.full(output["text"], output["finish_reason"])
        if with_token_ids:
            body["choices"][0]["token_ids"] = output["token_ids"]
        body["usage"] = usage(stream.request.num_prompt_tokens, len(output["token_ids"]))
        return body

    app.include_router(v1)
    return app
