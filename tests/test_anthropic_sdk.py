"""Anthropic's Messages API through the real ``anthropic`` SDK against the real server, once per sampler backend: a
reply's usage against ``count_tokens`` and the tokenizer, streams (the SDK's helper and raw events) equal to the whole
reply, stop sequences, ``max_tokens``, a forced tool call and its round trip, an adapter named by its ``tinker://``
path, and errors as the SDK's typed exceptions."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from tinker import types
from transformers import AutoTokenizer

from tests.helpers import BASE_MODEL, MAIN_KEY, make_datum, on_both_sampler_backends

server, service_client = on_both_sampler_backends()  # every test here runs once per sampler backend

SYSTEM = "Answer briefly."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TARGET = "Paris is the capital of France."
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                            "required": ["city"], "additionalProperties": False}}
CITY = {"city": "Paris"}
GREEDY = {"temperature": 0}
"""Sampling parameters go in ``extra_body``: this SDK's ``create`` has no ``temperature`` argument any more."""


def openai_tool(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": tool["input_schema"]}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=MAIN_KEY, max_retries=0)


def request(**fields) -> dict:
    return {"model": BASE_MODEL, "messages": ASK, "system": SYSTEM, "max_tokens": 16, "extra_body": GREEDY, **fields}


def create(client, **fields) -> anthropic.types.Message:
    return client.messages.create(**request(**fields))


@pytest.fixture(scope="module")
def whole(client) -> anthropic.types.Message:
    """The base model's greedy reply, which runs to ``max_tokens`` (the tiny model writes no end of turn so soon)."""
    return create(client)


@pytest.fixture(scope="module")
def adapter_path(service_client, tokenizer) -> str:
    """A LoRA adapter trained with the tinker SDK on two answers: TARGET to ASK (with SYSTEM), and, offered WEATHER,
    the arguments ``{"city": "Paris"}`` to WEATHER_ASK. The tiny base model's own greedy text is a run of newlines,
    which neither ends a stop-sequence test well nor closes a forced call's JSON."""
    lessons = [([{"role": "system", "content": SYSTEM}, *ASK], None, TARGET),
               (WEATHER_ASK, [openai_tool(WEATHER)], json.dumps(CITY))]
    data = []
    for chat, tools, answer in lessons:
        prompt = tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=True)
        completion = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        data.append(make_datum(list(prompt["input_ids"]), completion))
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
    adam = types.AdamParams(learning_rate=3e-3)
    for _ in range(25):
        step = client.forward_backward(data, "cross_entropy")
        client.optim_step(adam).result()
        step.result()
    return client.save_weights_for_sampler("anthropic-memorized").result().path


def test_a_reply_counts_the_prompt_as_count_tokens_and_the_tokenizer_do(server, client, tokenizer, whole):
    assert whole.type == "message" and whole.role == "assistant" and whole.model == BASE_MODEL
    assert whole.id.startswith("msg_") and [block.type for block in whole.content] == ["text"]
    chat = [{"role": "system", "content": SYSTEM}, *ASK]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    counted = client.messages.count_tokens(model=BASE_MODEL, messages=ASK, system=SYSTEM)
    assert whole.usage.input_tokens == counted.input_tokens == len(prompt)
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None and whole.usage.output_tokens == 16
    # The one sampler path: the OpenAI route's greedy reply to the same conversation is the same text
    openai = httpx.post(f"{server.base_url}/v1/chat/completions",
                        json={"model": BASE_MODEL, "messages": chat, "max_tokens": 16, "temperature": 0}).json()
    assert whole.content[0].text == openai["choices"][0]["message"]["content"]
    shorter = create(client, max_tokens=5)
    assert shorter.stop_reason == "max_tokens" and shorter.usage.output_tokens == 5


def test_an_adapter_named_by_its_path_answers_what_it_learned(client, adapter_path, whole):
    reply = create(client, model=adapter_path, max_tokens=40)
    assert reply.content[0].text == TARGET != whole.content[0].text and reply.model == adapter_path
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None  # its learned end of turn stopped it
    assert reply.usage.input_tokens == whole.usage.input_tokens


def test_streams_add_up_to_the_whole_reply(client, adapter_path):
    for model, max_tokens in [(adapter_path, 40), (BASE_MODEL, 16)]:
        whole = create(client, model=model, max_tokens=max_tokens)
        with client.messages.stream(**request(model=model, max_tokens=max_tokens)) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == whole.content[0].text
        assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
        assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
            whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens)
        events = list(client.messages.create(stream=True, **request(model=model, max_tokens=max_tokens)))
        kinds = [event.type for event in events]
        assert kinds[:2] == ["message_start", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
        assert len(deltas) > 1, "tokens must arrive as they are sampled, not in one piece"
        assert "".join(deltas) == whole.content[0].text
        assert events[0].message.usage.input_tokens == whole.usage.input_tokens
        assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == (whole.stop_reason,
                                                                                  whole.usage.output_tokens)


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client, adapter_path):
    stop = " capital"
    asked = request(model=adapter_path, max_tokens=40, stop_sequences=["never in this text", stop])
    reply = client.messages.create(**asked)
    assert reply.content[0].text == TARGET[:TARGET.find(stop)]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == reply.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_forced_tool_call_is_valid_input_and_goes_back_in_the_next_turn(client, tokenizer, adapter_path):
    forced = request(model=adapter_path, messages=WEATHER_ASK, system=anthropic.omit, max_tokens=40, tools=[WEATHER],
                     tool_choice={"type": "tool", "name": "get_weather"})
    reply = client.messages.create(**forced)
    (call,) = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert call.input == CITY and reply.stop_reason == "tool_use"  # forced, as Anthropic and vLLM answer it
    with client.messages.stream(**forced) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", call.name, call.input)]
    assert final.stop_reason == "tool_use"
    # The call and its result go back in the next turn, rendered by the template as the OpenAI conversation is
    follow = [*WEATHER_ASK, {"role": "assistant", "content": [call.model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    openai_chat = [*WEATHER_ASK, {"role": "assistant", "content": "", "tool_calls": [
                       {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    prompt = tokenizer.apply_chat_template(openai_chat, tools=[openai_tool(WEATHER)], add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
    counted = client.messages.count_tokens(model=BASE_MODEL, messages=follow, tools=[WEATHER])
    answer = client.messages.create(model=adapter_path, messages=follow, tools=[WEATHER], max_tokens=3)
    assert answer.usage.input_tokens == counted.input_tokens == len(prompt)


def raw(client, **fields):
    """A request the SDK's ``create`` would not send (a field left out, one it does not know): ``None`` leaves out."""
    body = {"model": BASE_MODEL, "messages": ASK, "max_tokens": 4, **fields}
    return client.post("/v1/messages", cast_to=object, body={k: v for k, v in body.items() if v is not None})


@pytest.mark.parametrize("call, error, kind", [
    (lambda c: create(c, model="no-such-model"), anthropic.NotFoundError, "not_found_error"),
    (lambda c: create(c, model="tinker://nobody:train:0/sampler_weights/x"), anthropic.NotFoundError,
     "not_found_error"),
    (lambda c: c.messages.count_tokens(model="no-such-model", messages=ASK), anthropic.NotFoundError,
     "not_found_error"),
    (lambda c: create(c, extra_body={"temperature": -1}), anthropic.BadRequestError, "invalid_request_error"),
    (lambda c: create(c, messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]), anthropic.BadRequestError, "invalid_request_error"),
    (lambda c: create(c, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), anthropic.BadRequestError,
     "invalid_request_error"),
    (lambda c: raw(c, max_tokens=None), anthropic.BadRequestError, "invalid_request_error"),
    (lambda c: raw(c, thinking={"type": "enabled", "budget_tokens": 1024}), anthropic.BadRequestError,
     "invalid_request_error"),
    (lambda c: create(c, stream=True, stop_sequences=[""]), anthropic.BadRequestError, "invalid_request_error"),
])
def test_errors_have_anthropics_shape_and_the_server_keeps_serving(client, call, error, kind):
    with pytest.raises(error) as info:
        call(client)
    assert info.value.body["type"] == "error" and set(info.value.body["error"]) == {"type", "message"}
    assert info.value.body["error"]["type"] == kind and info.value.body["error"]["message"]
    assert create(client, max_tokens=2).usage.output_tokens == 2


def test_a_bad_key_is_an_authentication_error_with_auth_keys(keyed_server):
    server, _ = keyed_server
    refused = anthropic.Anthropic(base_url=server.base_url, api_key="tml-not-registered", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        refused.messages.create(model=BASE_MODEL, messages=ASK, max_tokens=2)
    assert info.value.body["error"]["type"] == "authentication_error"
    raw = httpx.post(f"{server.base_url}/v1/messages/count_tokens", headers={"x-api-key": "tml-not-registered"},
                     json={"model": BASE_MODEL, "messages": ASK})
    assert raw.status_code == 401 and raw.json()["error"]["type"] == "authentication_error"
