"""shims.openai_wire: request checks, the mapping onto sampling requests, text assembly and token bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from shims.openai_wire import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    TextAssembler,
    Vocabulary,
    chat_messages,
    completion_prompts,
    parse_request,
    sample_request,
)
from shims.sample_job import SampleJob, SamplingLimits
from shims.sampling_math import penalized
from shims.sampling_wire import decode_sample_request

LIMITS = SamplingLimits(vocab_size=512, max_context=64, max_num_samples=8, max_logprobs_k=20)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> Vocabulary:
    return Vocabulary(AutoTokenizer.from_pretrained(tiny_model_dir))


def chat(**fields) -> ChatRequest:
    return parse_request(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("body, param, message", [
    ({"model": "m"}, "messages", "missing required parameter"),
    ({"model": "m", "messages": [], "tools": []}, "tools", "unsupported parameter"),
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
        sample_request(chat(**fields), [1, 2, 3])
    assert info.value.status == 400 and info.value.param == param


def test_parameters_map_onto_the_tinker_sampling_request():
    req = chat(n=3, temperature=0.5, top_p=0.9, max_tokens=7, max_completion_tokens=5, stop="##", seed=4,
               logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=-0.25)
    sample, penalties = sample_request(req, [1, 2, 3])
    job = decode_sample_request(sample, LIMITS)
    assert (job.prompt, job.num_samples, job.temperature, job.top_p, job.max_tokens) == ((1, 2, 3), 3, 0.5, 0.9, 5)
    assert (job.stop_strings, job.stop_at_eos, job.seed, job.topk_sample_logprobs) == (("##",), True, 4, 2)
    assert (penalties.presence, penalties.frequency) == (0.5, -0.25)
    # OpenAI's defaults: temperature 1, the end of the model's turn stops, a chat may use the whole context
    job = decode_sample_request(sample_request(chat(stop=[]), [1, 2, 3])[0], LIMITS)
    assert (job.temperature, job.stop_at_eos, job.stop_strings, job.max_tokens) == (1.0, True, (), 61)
    text = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 0})
    job = decode_sample_request(sample_request(text, [5])[0], LIMITS)
    assert job.max_tokens == 16 and job.topk_sample_logprobs == 0  # completions default to 16 tokens
    with pytest.raises(OpenAIError, match="echo"):
        sample_request(parse_request(CompletionRequest, {"model": "m", "prompt": "x", "echo": True}), [5])


def test_prompts_and_messages(vocab):
    assert chat_messages(parse_request(ChatRequest, {"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"}]})) == [{"role": "system", "content": "ab"}, {"role": "user", "content": "c"}]
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
