"""vLLM's offline API on nanovllm (a script written for vLLM runs with only its import changed): prompt
forms, RequestOutput / CompletionOutput attributes beside nano-vllm's dict keys, Logprob (rank against
transformers' whole distribution, decoded text), chat's options, a streamed chat, SamplingParams.clone,
and vLLM options nanovllm lacks raising TypeError by name."""

import json
import pickle

import pytest
import torch
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=256, max_num_seqs=8)


def test_every_prompt_form_runs_the_same_tokens(llm):
    text = PROMPTS[0]
    ids = llm.get_tokenizer().encode(text)
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids},
             {"prompt_token_ids": ids, "prompt": text}]
    outputs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert all(o.prompt_token_ids == ids for o in outputs)
    assert [o.prompt for o in outputs] == [text, None, text, None, text]
    (one,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)  # one dict: one prompt
    assert one.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    request_id = llm.add_request({"prompt": text}, GREEDY)
    finished = {}
    while not llm.is_finished():
        finished.update(llm.step()[0])
    assert finished[request_id].request_id == request_id and finished[request_id].prompt == text


def test_outputs_read_as_vllm_objects_and_as_dicts(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True, logprobs=1)
    output = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert isinstance(output, RequestOutput) and isinstance(output, dict)
    assert output.finished and "error" not in output
    assert output.num_cached_tokens == output["num_cached_tokens"]
    assert output.prompt_token_ids is output["prompt_token_ids"] and output.prompt_logprobs is None
    first = output.outputs[0]
    assert isinstance(first, CompletionOutput) and first.finished() and first.finish_reason == "length"
    for key in ("text", "token_ids", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob"):
        assert output[key] == first[key] == getattr(first, key)
    assert [c.index for c in output.outputs] == [0, 1]
    assert output.outputs[1].text == output["outputs"][1]["text"]
    again = pickle.loads(pickle.dumps(output))  # as outputs cross process pipes
    assert type(again) is RequestOutput and again == output
    assert (again.request_id, again.prompt) == (output.request_id, output.prompt)
    assert type(again.outputs[1]) is CompletionOutput and type(again.outputs[1].logprobs[0]) is dict


def hf_rank(row: torch.Tensor, token: int) -> int:
    return 1 + int((row > row[token]).sum())


def test_logprob_ranks_and_text_match_transformers(llm, hf_qwen3):
    k = 2
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=12, ignore_eos=True, logprobs=k,
                            prompt_logprobs=k)
    output = llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    prompt, completion = output.prompt_token_ids, output.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_qwen3(torch.tensor([prompt + completion])).logits[0].float(), dim=-1)
    tokenizer = llm.get_tokenizer()
    positions = [(output.prompt_logprobs[p], p - 1, prompt[p]) for p in range(1, len(prompt))]
    positions += [(output.outputs[0].logprobs[j], len(prompt) - 1 + j, t) for j, t in enumerate(completion)]
    num_outside_top_k = 0
    for entry, position, _ in positions:
        for token, lp in entry.items():
            assert isinstance(lp, Logprob) and abs(lp.logprob - ref[position, token].item()) < 1e-4
            assert lp.decoded_token == tokenizer.decode([token])
            assert lp.rank == hf_rank(ref[position], token)  # in the whole distribution, as vLLM's
            num_outside_top_k += lp.rank > k
    assert num_outside_top_k > 0  # the sampling above does pick outside the top 2
    plain = llm.generate(PROMPTS[3], SamplingParams(max_tokens=2, logprobs=1, detokenize=False),
                         use_tqdm=False)[0]
    assert all(lp.decoded_token is None for lp in plain.outputs[0].logprobs[0].values())


def test_logprob_is_its_float():
    class Decoder:
        calls = 0

        def decode(self, ids):
            Decoder.calls += 1
            return f"<{ids[0]}>"

    lp = Logprob(-0.5, 2, None, 7, Decoder())
    assert Decoder.calls == 0  # decoded when read, not when built
    assert lp == -0.5 and lp + 1 == 0.5 and str(lp) == "-0.5" and f"{lp:.1f}" == "-0.5"
    assert json.dumps({7: lp}) == '{"7": -0.5}'
    assert repr(lp) == "Logprob(logprob=-0.5, rank=2, decoded_token='<7>')" and Decoder.calls == 1
    again = pickle.loads(pickle.dumps(lp))
    assert (again.logprob, again.rank, again.decoded_token) == (-0.5, 2, "<7>") and Decoder.calls == 1


def test_chat_options(llm):
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Paris is"}]
    templated = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert templated.prompt.endswith("Paris is<|im_end|>\n<|im_start|>assistant\n")
    continued = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                         continue_final_message=True)[0]
    assert continued.prompt.endswith("<|im_start|>assistant\nParis is")
    own = llm.chat(conversation, GREEDY, use_tqdm=False,
                   chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")[0]
    assert own.prompt == "hello|Paris is|"
    assert own.prompt_token_ids == llm.get_tokenizer().encode("hello|Paris is|", add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(conversation, GREEDY, continue_final_message=True)
    with pytest.raises(TypeError, match=r"\['tools'\] are not supported"):
        llm.chat(conversation, GREEDY, tools=[])
    with pytest.raises(TypeError, match="chat_template_content_format"):
        llm.chat(conversation, GREEDY, chat_template_content_format="openai")


def test_stream_takes_a_conversation(llm):
    conversation = [{"role": "user", "content": PROMPTS[0]}]
    reply = llm.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert "".join(llm.stream(conversation, GREEDY)) == reply and reply
    continued = [*conversation, {"role": "assistant", "content": "Paris"}]
    options = dict(add_generation_prompt=False, continue_final_message=True)
    assert "".join(llm.stream(continued, GREEDY, **options)) == llm.chat(
        continued, GREEDY, use_tqdm=False, **options)[0].outputs[0].text
    with pytest.raises(TypeError, match="format a conversation"):
        llm.stream(PROMPTS[0], GREEDY, chat_template="{{ messages }}")


def test_vllm_options_nanovllm_lacks_are_named(llm):
    with pytest.raises(TypeError, match=r"generate\(\) options \['lora_request'\] are not supported"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=None)
    with pytest.raises(TypeError, match=r"prompt keys \['multi_modal_data'\] are not supported"):
        llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {}}, GREEDY)
    with pytest.raises(TypeError, match="'prompt' must be text"):
        llm.add_request({"prompt": [1, 2]}, GREEDY)
    with pytest.raises(TypeError, match="needs 'prompt'"):
        llm.add_request({}, GREEDY)
    with pytest.raises(TypeError, match=r"fields \['best_of'\] are not supported"):
        SamplingParams(best_of=2)
    assert llm.is_finished()  # nothing was queued


def test_clone_is_a_deep_copy():
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={1: 2.0}, seed=1)
    clone = params.clone()
    assert clone == params and clone is not params
    clone.stop.append("y")
    clone.logit_bias[2] = 1.0
    assert params.stop == ["x"] and params.logit_bias == {1: 2.0}
