"""OpenAI's Responses API (``/v1/responses``) through the real ``openai`` SDK against the real server, once per
sampler backend: each answer is checked against the chat completion of the same request, which the route samples
through."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers import BASE_MODEL, MAIN_KEY, on_both_sampler_backends

server, service_client = on_both_sampler_backends()  # every test here runs once per sampler backend

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                      "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMETERS, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "And in London?"}]},
]
CHAT_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And in London?"},
]
SEEDS = range(12)
"""Seeds tried for a constrained answer that closes its JSON within its token budget: the tiny model may write
whitespace for as long as the grammar allows it."""


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=MAIN_KEY, max_retries=0)


def completed(oai, **kwargs):
    """The first seed's response that completed (its JSON closed before the token limit)."""
    for seed in SEEDS:
        response = oai.responses.create(temperature=1, extra_body={"seed": seed}, **kwargs)
        if response.status == "completed":
            return response, seed
    raise AssertionError(f"no seed in {SEEDS} completed; the last response: {response.output}")


def test_a_conversation_is_answered_as_the_chat_completion_of_the_same_messages(oai):
    response = oai.responses.create(model=BASE_MODEL, instructions="Be brief.", input=CONVERSATION, tools=[WEATHER],
                                    temperature=0, max_output_tokens=12, metadata={"run": "a"}, store=True)
    chat = oai.chat.completions.create(model=BASE_MODEL, messages=CHAT_CONVERSATION, tools=[CHAT_WEATHER],
                                       temperature=0, max_tokens=12)
    choice = chat.choices[0]
    assert response.output_text == (choice.message.content or "")
    calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert response.id.startswith("resp_") and response.object == "response" and response.model == BASE_MODEL
    assert (response.instructions, response.temperature, response.max_output_tokens, response.metadata) == \
        ("Be brief.", 0, 12, {"run": "a"})
    assert [tool.name for tool in response.tools] == ["get_weather"] and response.tool_choice == "auto"


def test_reaching_max_output_tokens_makes_the_response_incomplete(oai):
    chat = oai.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0, max_tokens=3)
    assert chat.choices[0].finish_reason == "length"  # the model does not end its turn within 3 tokens
    response = oai.responses.create(model=BASE_MODEL, input="Hi", temperature=0, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output_text == chat.choices[0].message.content
    assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]


def test_a_stream_adds_up_to_the_whole_response(oai):
    kwargs = {"model": BASE_MODEL, "input": "Tell me about Paris.", "temperature": 1, "max_output_tokens": 24,
              "extra_body": {"seed": 7}}
    whole = oai.responses.create(**kwargs)
    events = list(oai.responses.create(stream=True, **kwargs))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events if event.type != "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", f"response.{whole.status}"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1, "text must arrive as it is sampled, not in one piece"
    assert "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == whole.status
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert final.output[0].id == events[2].item.id == events[-2].item.id


def test_a_json_schema_text_format_constrains_the_output(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    kwargs = {"model": BASE_MODEL, "input": "The weather, as JSON.", "max_output_tokens": 64,
              "text": {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}}
    response, seed = completed(oai, **kwargs)
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema
    # the SDK's stream helper reads the same answer from the stream and its response.completed event
    with oai.responses.stream(temperature=1, extra_body={"seed": seed}, **kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_text == response.output_text


def test_a_named_function_is_called_with_arguments_its_parameters_accept(oai):
    kwargs = {"model": BASE_MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 64,
              "tool_choice": {"type": "function", "name": "get_weather"}}
    response, seed = completed(oai, **kwargs)
    [call] = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)

    events = list(oai.responses.create(stream=True, temperature=1, extra_body={"seed": seed}, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[2:-1] == ["response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.done", "response.output_item.done"]
    assert events[3].delta == events[4].arguments == call.arguments == events[-1].response.output[0].arguments

    # the next turn passes the call back with its output, as the SDK's docs do
    follow = oai.responses.create(model=BASE_MODEL, tools=[WEATHER], temperature=0, max_output_tokens=2, input=[
        {"role": "user", "content": "Weather in Paris?"}, *response.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > response.usage.input_tokens


@pytest.mark.parametrize("kwargs, error, param", [
    ({"previous_response_id": "resp_123"}, openai.BadRequestError, "previous_response_id"),
    ({"model": "no-such-model"}, openai.NotFoundError, "model"),
    ({"tools": [{"type": "web_search"}]}, openai.BadRequestError, "tools[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, openai.BadRequestError,
     "text.format.schema"),
])
def test_errors_have_openai_shape_and_name_the_parameter(oai, kwargs, error, param):
    with pytest.raises(error) as info:
        oai.responses.create(**{"model": BASE_MODEL, "input": "Hi", **kwargs})
    assert info.value.body["param"] == param and info.value.body["message"]
