"""shims.openai.wire: request checks, the mapping onto sampling requests, text assembly and token bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from shims.openai.errors import OpenAIError
from shims.openai.limits import OpenAILimits
from shims.openai.params import sampling_job
from shims.openai.text import TextAssembler, Vocabulary
from shims.openai.wire import ChatRequest, CompletionRequest, chat_messages, completion_prompts, parse_request
from shims.sampling.arithmetic import penalized
from shims.sampling.job import SampleJob, SamplingLimits

LIMITS = SamplingLimits(vocab_size=512, max_context=64, max_num_samples=8, max_logprobs_k=20)
OPENAI = OpenAILimits(max_stop=4, max_temperature=2)


def job_of(req, prompt=(1, 2, 3), openai=OPENAI) -> SampleJob:
    return sampling_job(req, list(prompt), LIMITS, openai)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> Vocabulary:
    return Vocabulary(AutoTokenizer.from_pretrained(tiny_model_dir))


def chat(**fields) -> ChatRequest:
    return parse_request(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("body, param, message", [
    ({"model": "m"}, "messages", "missing required parameter"),
    ({"model": "m", "messages": [], "best_of": 3}, "best_of", "unsupported parameter"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "only text content"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "invalid value"),
    ({"model": "m", "messages": [], "n": "two"}, "n", "invalid value"),
])
def test_bad_requests_name_the_parameter(body, param, message):
    with pytest.raises(OpenAIError) as info:
        parse_request(ChatRequest, body)
    assert info.value.status == 400 and info.value.param == param and message in info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.1}, "frequency_penalty"), ({"n": 0}, "n"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"max_completion_tokens": 0}, "max_tokens"),
])
def test_out_of_range_parameters_are_400s(fields, param):
    with pytest.raises(OpenAIError) as info:
        job_of(chat(**fields))
    assert info.value.status == 400 and info.value.param == param


def test_parameters_map_onto_the_tinker_sampling_request():
    req = chat(n=3, temperature=0.5, top_p=0.9, max_tokens=7, max_completion_tokens=5, stop="##", seed=4,
               logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=-0.25)
    job = job_of(req)
    assert (job.prompt, job.num_samples, job.temperature, job.top_p, job.max_tokens) == ((1, 2, 3), 3, 0.5, 0.9, 5)
    assert (job.stop_strings, job.stop_at_eos, job.seed, job.topk_sample_logprobs) == (("##",), True, 4, 2)
    assert (job.presence_penalty, job.frequency_penalty) == (0.5, -0.25)
    # OpenAI's defaults: temperature 1, the end of the model's turn stops, a chat may use the whole context
    job = job_of(chat(stop=[]))
    assert (job.temperature, job.stop_at_eos, job.stop_strings, job.max_tokens) == (1.0, True, (), 61)
    text = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 0})
    job = job_of(text, [5])
    assert job.max_tokens == 16 and job.topk_sample_logprobs == 0  # completions default to 16 tokens


def test_vllm_extensions_map_onto_the_job():
    job = job_of(chat(min_p=0.1, repetition_penalty=1.3, logit_bias={"7": 5, "9": -100}, stop_token_ids=[4, 5],
                      ignore_eos=True, top_k=3))
    assert (job.min_p, job.repetition_penalty, job.logit_bias) == (0.1, 1.3, ((7, 5.0), (9, -100.0)))
    assert (job.stop_token_ids, job.stop_at_eos, job.top_k) == ((4, 5), False, 3)
    # echo with logprobs asks the backend for the prompt's logprobs and top-k; max_tokens 0 still samples one token
    echo = job_of(parse_request(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 3, "max_tokens": 0}))
    assert (echo.prompt_logprobs, echo.topk_prompt_logprobs, echo.topk_sample_logprobs, echo.max_tokens) == (
        True, 3, 3, 1)
    with pytest.raises(OpenAIError, match="max_tokens must be at least 1"):
        job_of(parse_request(CompletionRequest, {"prompt": "x", "max_tokens": 0}))
    for bad, param in [({"logit_bias": {"512": 1}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
                       ({"logit_bias": {"3": 101}}, "logit_bias"), ({"stop_token_ids": [600]}, "stop_token_ids"),
                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p")]:
        with pytest.raises(OpenAIError) as info:
            job_of(chat(**bad))
        assert info.value.param == param


def test_limits_are_configurable_and_default_to_vllms():
    many_stops, hot = chat(stop=["a", "b", "c", "d", "e", "f"]), chat(temperature=3.5)
    assert job_of(many_stops, openai=OpenAILimits()).stop_strings == ("a", "b", "c", "d", "e", "f")
    assert job_of(hot, openai=OpenAILimits(max_temperature=None)).temperature == 3.5
    assert job_of(chat(logprobs=True, top_logprobs=20), openai=OpenAILimits()).topk_sample_logprobs == 20
    with pytest.raises(OpenAIError, match="up to 4"):
        job_of(many_stops)
    with pytest.raises(OpenAIError, match="between 0 and 2"):
        job_of(hot, openai=OpenAILimits())
    with pytest.raises(OpenAIError, match="between 0 and 5"):
        job_of(parse_request(CompletionRequest, {"prompt": "x", "logprobs": 6}), openai=OpenAILimits(max_logprobs=5))


def test_unknown_fields_are_ignored_and_named_but_result_changing_ones_refused():
    from shims.openai.wire import ignored_fields

    req = chat(store=True, metadata={"a": "b"}, service_tier="auto", best_of=1, modalities=["text"])
    assert ignored_fields(req) == ["best_of", "metadata", "modalities", "service_tier", "store"]
    for field, value in [("best_of", 2), ("use_beam_search", True), ("min_tokens", 3), ("suffix", "x")]:
        with pytest.raises(OpenAIError, match="not supported") as info:
            chat(**{field: value})
        assert info.value.param == field


def test_prompts_and_messages(vocab):
    assert chat_messages(parse_request(ChatRequest, {"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"}]}).messages) == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "c"}]  # parts joined as vLLM joins them
    prompts = {"x y": [vocab.encode("x y")], "": None}
    for prompt, expected in [("x y", prompts["x y"]), (["a", "b"], [vocab.encode("a"), vocab.encode("b")]),
                             ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]])]:
        req = parse_request(CompletionRequest, {"model": "m", "prompt": prompt})
        assert completion_prompts(req, vocab.encode) == expected
    with pytest.raises(OpenAIError, match="must not be empty"):
        completion_prompts(parse_request(CompletionRequest, {"model": "m", "prompt": ""}), vocab.encode)
    rendered = vocab.render_chat([{"role": "user", "content": "Hi there"}])
    assert vocab.tokenizer.decode(rendered) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_token_bytes_are_exact_even_inside_a_character(vocab):
    text = "héllo 日本 Paris"
    tokens = vocab.encode(text)
    assert b"".join(vocab.token_bytes(t) for t in tokens) == text.encode()
    assert any(len(vocab.token_text(t)) == 1 and vocab.token_text(t) == "\ufffd" for t in tokens)  # a partial char


@pytest.mark.parametrize("stops", [[], ["Paris"], ["日"], [" 日本 P"]])
def test_streamed_text_concatenates_to_the_whole_text(vocab, stops):
    tokens = vocab.encode("héllo 日本 Paris is nice")
    whole = TextAssembler(vocab, stops).push(tokens, final=True)
    streamed = TextAssembler(vocab, stops)
    deltas = [streamed.push([t]) for t in tokens] + [streamed.push([], final=True)]
    assert "".join(deltas) == whole
    assert all("\ufffd" not in d for d in deltas)  # never half a character
    full = vocab.decode(tokens)
    cut = min((full.find(s) for s in stops if s in full), default=len(full))
    assert whole == full[:cut]  # ends before the first stop string


def test_penalties_subtract_per_occurrence_and_once_per_presence():
    logits = torch.zeros(6)
    job = SampleJob(prompt=(1,), presence_penalty=0.5, frequency_penalty=0.25)
    out = penalized(logits, job, [2, 2, 2, 4])
    assert out.tolist() == pytest.approx([0, 0, -1.25, 0, -0.75, 0])
    assert penalized(logits, SampleJob(prompt=(1,)), [2]) is logits  # no penalties: untouched
