"""`nanovllm serve MODEL [options]`: load the model, then serve it over HTTP with uvicorn. Every
engine option of `LLM(...)` is a flag in vLLM's spelling (`max_model_len` -> `--max-model-len`,
booleans as `--enforce-eager` / `--no-enforce-eager`), built from Config's fields so the two never
drift apart; vLLM's own names for a few are accepted too (`-tp`, `--block-size`,
`--num-gpu-blocks-override`). The engine runs in a process of its own (one per data-parallel
replica; nanovllm.serve.engine_client), and `serve` waits until it is built: an engine that fails
to start ends `serve` with its error and status 1. SIGTERM or Ctrl-C: uvicorn stops accepting, lets
the requests in flight finish for up to --graceful-timeout seconds, then the rest are aborted (a
stream ends with an error event and `data: [DONE]`, a waiting client gets a 503) and the engine
process stopped. The served model's id defaults to the model folder's or file's name (or the short
name, `nanovllm serve smollm2`), never a full path: it shows in every response and in /metrics."""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import types
import typing
from dataclasses import MISSING, Field, fields

from nanovllm.config import (
    LARGE_GPU_BYTES,
    MAX_NUM_SEQS,
    MAX_NUM_SEQS_LARGE_GPU,
    VALID_ATTENTION_BACKENDS,
    VALID_DEVICES,
    VALID_DTYPES,
    VALID_KV_CACHE_DTYPES,
    VALID_LOAD_FORMATS,
    Config,
)
from nanovllm.serve.admission import MAX_REQUEST_BYTES
from nanovllm.serve.engine_client import STEP_TIMEOUT_S
from nanovllm.serve.tool_calls import TOOL_PARSERS
from nanovllm.utils.config_checks import VALID_QUANTIZATIONS

CHOICES = {"dtype": VALID_DTYPES, "device": VALID_DEVICES, "load_format": VALID_LOAD_FORMATS,
           "attention_backend": VALID_ATTENTION_BACKENDS, "kv_cache_dtype": VALID_KV_CACHE_DTYPES,
           "quantization": [q for q in VALID_QUANTIZATIONS if q is not None]}
ALIASES = {"tensor_parallel_size": ["-tp"], "kvcache_block_size": ["--block-size"],
           "num_kvcache_blocks": ["--num-gpu-blocks-override"]}
# What an option left at None means (the engine decides), for --help.
NONE_MEANS = {"max_num_seqs": f"{MAX_NUM_SEQS_LARGE_GPU} on a GPU of {LARGE_GPU_BYTES >> 30} GiB or more, "
                              f"else {MAX_NUM_SEQS}",
              "num_kvcache_blocks": "sized from free memory"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Seconds that in-flight requests get to finish after SIGTERM before they are aborted.
GRACEFUL_TIMEOUT_S = 30
# After the aborts, uvicorn waits this much longer for the aborted requests' last events to go out
# before it cuts the connections.
ABORT_GRACE_S = 2.0


def _int_or_word(value: str) -> int | str:
    """For options that take a number or a word (cpu_threads: 4 or "auto")."""
    return int(value) if value.strip().isdigit() else value


def _json_object(value: str) -> dict:
    """For options that take a dict (speculative_config): JSON text, as vLLM's flags take it."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return parsed


def _base_type(annotation):
    """int for `int`, `int | None` and `Optional[int]`; a number-or-word parser for `int | str`; JSON for
    an option that takes a dict."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if set(kinds) == {int, str}:
            return _int_or_word
        if dict in kinds:
            return _json_object
        (annotation,) = kinds
    return annotation


def _default(f: Field):
    """An option's default; a factory default (one an environment variable may set) is called."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def add_engine_options(parser: argparse.ArgumentParser) -> list[str]:
    """One flag per Config option; returns the option names."""
    group = parser.add_argument_group("engine options (as LLM(...) takes them)")
    names = []
    for f in fields(Config):
        if not f.init or f.name == "model":
            continue
        kind = _base_type(f.type)
        flags = [f"--{f.name.replace('_', '-')}", *ALIASES.get(f.name, [])]
        default = _default(f)
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        else:
            shown = NONE_MEANS.get(f.name, default) if default is None else default
            group.add_argument(*flags, dest=f.name, type=kind, default=default, choices=CHOICES.get(f.name),
                               help=f"default: {shown}")
        names.append(f.name)
    return names


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(prog="nanovllm serve", description="OpenAI-compatible server")
    parser.add_argument("model", help="a Hugging Face model folder, a .gguf file, or a short name (smollm2)")
    parser.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: MODEL's folder or file name)")
    parser.add_argument("--graceful-timeout", type=float, default=GRACEFUL_TIMEOUT_S,
                        help="seconds in-flight requests may finish after SIGTERM")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--engine-step-timeout", type=float, default=STEP_TIMEOUT_S,
                        help="seconds an engine with requests in flight may go without finishing a step "
                             "before it is taken for hung: stopped, its requests failed, /health 503 "
                             f"(default {STEP_TIMEOUT_S:.0f}; 0: never)")
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                        help=f"larger request bodies get a 413 (default {MAX_REQUEST_BYTES})")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no throughput line in the log (vLLM's flag)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="streamed responses send a chunk every this-many tokens (vLLM's flag; "
                             "default 1: each token as it is generated)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the format the model writes tool calls in, for tool_choice 'auto' (vLLM's "
                             "flag; 'hermes': <tool_call>{...}</tool_call>, as Qwen's and Hermes' models)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice 'auto' (OpenAI's default with tools): generation stays "
                             "free and --tool-call-parser finds the calls (vLLM's flag)")
    return parser, add_engine_options(parser)


def served_model_name(model: str) -> str:
    """A model's default id: its folder's or file's name (a short name stays as it is)."""
    return os.path.basename(os.path.normpath(model)) or model


def _server_class(uvicorn, engine, graceful_timeout: float):
    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, which would kill the process before
        the engine is shut down and exit with status -15; this one returns, and exits with 0. Past the
        graceful timeout it aborts what is still running (each request ends with an error the client
        sees), then gives uvicorn ABORT_GRACE_S to send those last events before it cuts connections."""

        async def shutdown(self, sockets=None):
            timer = asyncio.get_running_loop().call_later(
                graceful_timeout, engine.abort_all,
                f"the server is stopping and --graceful-timeout ({graceful_timeout:g} s) has passed")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    return Server


def serve_main(argv: list[str] | None = None) -> int:
    try:
        import uvicorn

        from nanovllm.serve.app import build_app
        from nanovllm.serve.engine_client import EngineClient, EngineStartError
    except ImportError as e:
        print(f"the server needs the serve extra ({e.name} is missing): pip install -e \".[serve]\"",
              file=sys.stderr)
        return 2
    parser, engine_names = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.host not in LOOPBACK:
        logging.warning("listening on %s: reachable beyond this machine%s", args.host,
                        "" if args.api_key else ", and with no --api-key")
    if args.stream_interval < 1:
        parser.error(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be at least 1, got {args.max_request_bytes}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the format to find calls in), "
                     f"one of {sorted(TOOL_PARSERS)}")
    if args.engine_step_timeout < 0:
        parser.error(f"--engine-step-timeout must be >= 0 (0: never), got {args.engine_step_timeout}")
    options = {name: getattr(args, name) for name in engine_names}
    defaults = {f.name: _default(f) for f in fields(Config) if f.init}
    options = {k: v for k, v in options.items() if v != defaults.get(k)}  # pass only what was set
    try:
        engine = EngineClient(args.model, options, step_timeout=args.engine_step_timeout)
    except (TypeError, ValueError) as e:  # the options, checked in this process first
        parser.error(str(e))
    except EngineStartError as e:
        if e.traceback:
            logging.debug("the engine process's traceback:\n%s", e.traceback)
        print(f"nanovllm serve: the engine failed to start: {e}"
              + ("" if args.log_level == "debug" else " (--log-level debug shows its traceback)"),
              file=sys.stderr)
        return 1
    try:
        app = build_app(engine, args.served_model_name or served_model_name(args.model), args.api_key,
                        args.stream_interval, args.max_request_bytes, not args.disable_log_stats,
                        args.tool_call_parser, args.enable_auto_tool_choice)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.graceful_timeout + ABORT_GRACE_S)
        _server_class(uvicorn, engine, args.graceful_timeout)(config).run()
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `nanovllm` console script: `nanovllm serve MODEL [options]`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print("usage: nanovllm serve MODEL [options]   (nanovllm serve --help for the options)",
              file=sys.stderr)
        return 2
    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
