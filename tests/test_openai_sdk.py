"""The OpenAI facade through the real ``openai`` SDK (sync and async) against the real server, on base models and on
an adapter trained in the same test session by the real ``tinker`` SDK, once per sampler backend."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest
from tinker import types
from transformers import AutoTokenizer

from tests.helpers import BASE_MODEL, MAIN_KEY, make_datum, on_both_sampler_backends, settled_decoded_tokens, train

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TARGET = "The capital of France is Paris."

server, service_client = on_both_sampler_backends()  # every test here runs once per sampler backend


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=MAIN_KEY, max_retries=0)


@pytest.fixture(scope="module")
def adapter_path(service_client, tokenizer) -> str:
    """A LoRA adapter trained with the tinker SDK to answer MESSAGES with TARGET, saved for sampling."""
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    completion = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
    train(client, make_datum(list(prompt), completion), 25, types.AdamParams(learning_rate=3e-3))
    return client.save_weights_for_sampler("openai-memorized").result().path


def chat(oai, model, **kwargs):
    return oai.chat.completions.create(model=model, messages=MESSAGES, **kwargs)


def test_adapter_answers_with_what_it_learned_and_the_base_model_does_not(oai, adapter_path, tokenizer):
    for model in (adapter_path, f"{BASE_MODEL};{adapter_path}"):
        reply = chat(oai, model, temperature=0, max_tokens=40)
        assert reply.choices[0].message.content == TARGET
        assert reply.choices[0].finish_reason == "stop"  # the learned end-of-turn token stopped it
        assert reply.choices[0].message.role == "assistant" and reply.model == model
    base = chat(oai, BASE_MODEL, temperature=0, max_tokens=12)
    assert base.choices[0].message.content != TARGET
    prompt_tokens = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert base.usage.prompt_tokens == prompt_tokens
    assert base.usage.completion_tokens == 12 and base.usage.total_tokens == prompt_tokens + 12
    assert base.choices[0].finish_reason == "length"
    listed = [m.id for m in oai.models.list().data]
    assert BASE_MODEL in listed and adapter_path in listed
    assert oai.models.retrieve(adapter_path).id == adapter_path


def test_stop_strings_end_the_text_before_them(oai, adapter_path):
    reply = chat(oai, adapter_path, temperature=0, max_tokens=40, stop=[" France"])
    assert reply.choices[0].message.content == "The capital of"
    assert reply.choices[0].finish_reason == "stop"
    streamed = chat(oai, adapter_path, temperature=0, max_tokens=40, stop=" France", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "The capital of"


def test_streaming_is_incremental_and_matches_the_whole_response(oai, adapter_path):
    for model, kwargs in [(adapter_path, {"temperature": 0}), (BASE_MODEL, {"seed": 7, "temperature": 1.0})]:
        whole = chat(oai, model, max_tokens=30, **kwargs)
        chunks = list(chat(oai, model, max_tokens=30, stream=True, stream_options={"include_usage": True}, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(contents) > 1, "tokens must arrive as they are sampled, not in one piece"
        assert "".join(contents) == whole.choices[0].message.content
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [c.choices[0].finish_reason for c in finals] == [whole.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_a_stream_of_several_choices_gives_each_its_text_finish_reason_and_usage(oai):
    """n > 1 streamed, the choices ending at different steps: each index's deltas add up to that choice of the same
    seeded request unstreamed, with its own finish reason, and usage counts every choice's tokens."""
    kwargs = {"model": BASE_MODEL, "n": 4, "seed": 21, "temperature": 1.0, "max_tokens": 24, "stop": ["e", "o"]}
    whole = chat(oai, **kwargs)
    chunks = list(chat(oai, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, finishes = {i: "" for i in range(4)}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert choice.index not in finishes, "a choice finished twice"
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(4)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(4)] == [c.finish_reason for c in whole.choices]
    assert "stop" in finishes.values() and len({len(t) for t in texts.values()}) > 1  # they ended apart
    assert chunks[-1].usage == whole.usage


LONG = 2000
"""Tokens of a long greedy completion: nearly the tiny model's whole context."""


@pytest.fixture(scope="module")
def long_request(oai) -> tuple[dict, float]:
    """A request whose greedy completion runs to ``LONG`` tokens without an EOS, and how long that takes here, so
    the abandonment tests can tell "stopped early" from "ran to the end" on a machine of any speed."""
    request = {"model": BASE_MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": LONG}
    oai.completions.create(**{**request, "max_tokens": 2})  # first use: the tokenizer loads, the sampler warms up
    started = time.monotonic()
    whole = oai.completions.create(**request)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == LONG
    return request, time.monotonic() - started


def test_a_stream_closed_by_its_client_stops_sampling(server, oai, long_request):
    """vLLM's server aborts a request whose client disconnects; so does this one, instead of decoding on to
    ``max_tokens`` for nobody."""
    request, _ = long_request
    before = settled_decoded_tokens(server)
    stream = oai.completions.create(stream=True, **request)
    first = next(iter(stream))
    assert first.choices[0].text is not None
    stream.close()
    decoded = settled_decoded_tokens(server) - before
    assert 1 <= decoded < LONG / 2, f"{decoded} of {LONG} tokens were decoded for a stream read once and closed"
    again = oai.completions.create(**{**request, "max_tokens": 5})
    assert again.choices[0].finish_reason == "length"  # the sampler still serves


def test_a_whole_request_whose_client_gives_up_stops_sampling(server, long_request):
    """A non-streamed request whose client times out (and closes its connection) is cancelled in the sampler too."""
    request, whole_seconds = long_request
    impatient = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=MAIN_KEY,
                              timeout=max(whole_seconds / 5, 0.5), max_retries=0)
    before = settled_decoded_tokens(server)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(**request)
    decoded = settled_decoded_tokens(server) - before
    assert 1 <= decoded < LONG * 0.75, f"{decoded} of {LONG} tokens were decoded for a request abandoned early"
    assert "went away before its answer" in server.log()


def test_n_logprobs_and_seeds(oai, service_client):
    reply = chat(oai, BASE_MODEL, n=3, seed=11, max_tokens=8, logprobs=True, top_logprobs=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    for choice in reply.choices:
        for entry in choice.logprobs.content:
            assert len(entry.top_logprobs) == 3
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6  # nothing beats the best alternative
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                       reverse=True)
    again = chat(oai, BASE_MODEL, n=3, seed=11, max_tokens=8)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    other = chat(oai, BASE_MODEL, n=3, seed=12, max_tokens=8)
    assert [c.message.content for c in other.choices] != [c.message.content for c in reply.choices]


def test_logprobs_are_the_models_own(oai, service_client, adapter_path, tokenizer):
    """The adapter's greedy reply is known token by token, so its logprobs can be checked against the tinker SDK's
    compute_logprobs of the same tokens under the same weights."""
    reply = chat(oai, adapter_path, temperature=0, max_tokens=40, logprobs=True)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    completion = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    content = reply.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == TARGET.encode() + tokenizer.eos_token.encode()
    sampler = service_client.create_sampling_client(model_path=adapter_path).result()
    expected = sampler.compute_logprobs(types.ModelInput.from_ints(list(prompt) + completion)).result()
    np.testing.assert_allclose([e.logprob for e in content], expected[len(prompt):], atol=1e-4)


def test_penalties_change_greedy_output(oai):
    plain = chat(oai, BASE_MODEL, temperature=0, max_tokens=24, logprobs=True)
    tokens = [tuple(e.bytes) for e in plain.choices[0].logprobs.content]
    assert len(set(tokens)) < len(tokens), "the tiny model's greedy reply repeats tokens"
    penalized = chat(oai, BASE_MODEL, temperature=0, max_tokens=24, logprobs=True, frequency_penalty=2.0,
                     presence_penalty=2.0)
    assert penalized.choices[0].message.content != plain.choices[0].message.content


def test_text_completions(oai, tokenizer):
    prompt = "The capital of France is"
    reply = oai.completions.create(model=BASE_MODEL, prompt=prompt, max_tokens=6, logprobs=2, seed=3)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert reply.usage.completion_tokens == len(reply.choices[0].logprobs.tokens) == 6
    # As vLLM: each position's entries are the token itself and its top 2, keyed by token text (so two alternatives
    # that decode alike, e.g. halves of characters, share one entry)
    logprobs = reply.choices[0].logprobs
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(top[token] == lp for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                                          logprobs.top_logprobs))
    several = oai.completions.create(model=BASE_MODEL, prompt=["a b", "c"], n=2, max_tokens=4, seed=3)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.usage.prompt_tokens == sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in ["a b", "c"])
    ids = oai.completions.create(model=BASE_MODEL, prompt=[[11, 42, 77], [5]], max_tokens=4, seed=3)
    assert ids.usage.prompt_tokens == 4 and len(ids.choices) == 2
    chunks = list(oai.completions.create(model=BASE_MODEL, prompt=prompt, max_tokens=6, seed=3, logprobs=2,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client(server, adapter_path):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=MAIN_KEY, max_retries=0)
        whole, stream = await asyncio.gather(
            client.chat.completions.create(model=adapter_path, messages=MESSAGES, temperature=0, max_tokens=40),
            client.chat.completions.create(model=adapter_path, messages=MESSAGES, temperature=0, max_tokens=40,
                                           stream=True))
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(main())
    assert whole == streamed == TARGET


@pytest.mark.parametrize("call, status, error_type, param", [
    (lambda c: chat(c, "no-such-model"), openai.NotFoundError, 404, "model"),
    (lambda c: chat(c, "tinker://nobody:train:0/sampler_weights/x"), openai.NotFoundError, 404, "model"),
    (lambda c: chat(c, BASE_MODEL, temperature=-1), openai.BadRequestError, 400, "temperature"),
    (lambda c: chat(c, BASE_MODEL, tool_choice="required"), openai.BadRequestError, 400, "tool_choice"),
    (lambda c: c.get("/no-such-route", cast_to=object), openai.NotFoundError, 404, None),
    (lambda c: c.delete("/chat/completions", cast_to=object), openai.APIStatusError, 405, None),
    (lambda c: chat(c, BASE_MODEL, top_logprobs=2), openai.BadRequestError, 400, "top_logprobs"),
    (lambda c: c.completions.create(model=BASE_MODEL, prompt=[99999]), openai.BadRequestError, 400, None),
])
def test_errors_have_openai_shape_and_the_server_keeps_serving(oai, call, status, error_type, param):
    with pytest.raises(status) as info:
        call(oai)
    assert info.value.status_code == error_type
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param and body["message"]
    assert chat(oai, BASE_MODEL, max_tokens=2).choices[0].message.content is not None


def test_open_auth_takes_no_key_or_any_other_key_as_one_anonymous_tenant(server):
    """lm-eval, litellm and vLLM habits: ``api_key="EMPTY"``, a made-up ``sk-…`` key, or none at all."""
    for api_key in ("EMPTY", "sk-not-ours"):
        oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0)
        assert chat(oai, BASE_MODEL, max_tokens=2).choices[0].message.content is not None
    raw = httpx.post(f"{server.base_url}/v1/chat/completions",
                     json={"model": BASE_MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert raw.status_code == 200, raw.text
    me = [httpx.get(f"{server.base_url}/api/v1/auth/apikey/me", headers=headers).json()
          for headers in ({}, {"Authorization": "Bearer EMPTY"}, {"X-API-Key": "sk-not-ours"},
                          {"X-API-Key": "tml-test-not-anonymous"})]
    assert me[0]["name"] == "anonymous" and me[0]["key_id"] == me[1]["key_id"] == me[2]["key_id"]
    assert me[3]["key_id"] != me[0]["key_id"] and me[3]["name"] != "anonymous"
    assert "anonymous tenant" in server.log_path.read_text()  # the ready line says so


def test_bad_or_missing_key_is_401_with_auth_keys(keyed_server):
    server, _ = keyed_server
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-not-ours", max_retries=0).models.list()
    assert info.value.body["code"] == "invalid_api_key"
    raw = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": BASE_MODEL, "messages": MESSAGES})
    assert raw.status_code == 401 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
