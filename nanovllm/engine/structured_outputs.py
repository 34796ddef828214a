"""Structured outputs: compiles a request's StructuredOutputsParams (JSON schema, regex, choice, EBNF
grammar, any JSON object) with xgrammar into a grammar over the model's vocabulary, and gives each of
its sequences a matcher of its own. The matcher lives on the sequence (`seq.grammar`): the runner
fills the row's token bitmask from it each step (runner/inputs.py, before sampling) and the stop
checker advances it with each accepted token (requests.py), so its state always matches the
sequence's tokens, through preemption (a recomputed sequence keeps its tokens, hence its matcher).

xgrammar is optional (`pip install 'nanovllm[structured]'`) and imports torch, so it is imported here
only when a request asks for structured outputs: this module, like the rest of engine/, imports
without torch."""

import json
import re
import threading
from collections import OrderedDict

from nanovllm.sampling_params import StructuredOutputsParams

INSTALL = "pip install 'nanovllm[structured]'"
# Compiled grammars kept, by constraint text: a service sees a few schemas over and over, and one
# compiled grammar holds a per-token table of the vocabulary (a few hundred KB to MBs).
MAX_CACHED_GRAMMARS = 256
# xgrammar's C++ errors start with "[time] file.cc:line: "; the rest is the message a user needs.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false: )?")


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError(f"structured outputs need the xgrammar package: {INSTALL}") from None
    return xgrammar


def constraint_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the constraint as the cache knows it (a dict schema as its JSON text; its keys not
    sorted: xgrammar generates properties in the schema's order)."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        text = schema if isinstance(schema, str) else json.dumps(schema)
    elif kind == "choice":
        text = json.dumps(params.choice)
    elif kind == "json_object":
        text = ""
    else:
        text = getattr(params, kind)
    return kind + ("-compact" if params.disable_any_whitespace else ""), text


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class GrammarCompiler:
    """One engine's compiler over its tokenizer, built on the first structured request (reading the
    vocabulary takes ~0.1 s). `compile` runs synchronously in add_request, before the engine's lock
    is taken: steps (and requests added from other threads) go on meanwhile, and a rejected
    constraint raises to the caller that sent it, before anything is queued. A background compile
    with the scheduler skipping the request until ready would also hide the compile from the caller
    of add_request, but it adds a state to the scheduler for a cost that is ~10 ms for a typical
    schema and cached afterwards."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's vocabulary
        self.eos_token_ids = list(eos_token_ids)  # the grammar's end: allowed only where it may end
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar of `params` (xgrammar.CompiledGrammar), from the cache when the same
        constraint was compiled before. Raises ValueError naming the problem for a constraint xgrammar
        rejects, and ImportError naming the extra when xgrammar is not installed."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, but skip_tokenizer_init=True")
        params.validate()  # fields may have changed since construction
        key = constraint_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiled = self._compile(params, key[1])
            self._cache[key] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, params: StructuredOutputsParams, text: str) -> object:
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info)
        compiler, kind = self._compiler, params.kind
        any_whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(text)
        except RuntimeError as e:
            message = _CPP_PREFIX.sub("", str(e)).strip()
            raise ValueError(f"structured_outputs.{kind} is not a constraint xgrammar can compile: "
                             f"{message}") from None


def grammar_matcher(compiled: object) -> object:
    """A fresh matcher (xgrammar.GrammarMatcher) over a compiled grammar, for one sequence."""
    return _xgrammar().GrammarMatcher(compiled)


def grammar_prefix(matcher: object, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the sequence's grammar allows after its tokens so far (speculative
    decoding verifies no draft its grammar forbids); the matcher is left as it was."""
    num = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        num += 1
        if matcher.is_terminated():  # an accepted stop token: nothing may follow it
            break
    matcher.rollback(num)
    return drafts[:num]
