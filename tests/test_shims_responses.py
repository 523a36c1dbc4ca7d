"""shims.responses.wire and shims.responses.out: Responses requests → OpenAI chat bodies (checked by the chat layer and
rendered by the tiny model's template), chat completions → responses, and streams that add up to the whole response
as the ``openai`` SDK's own stream accumulator reads them."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from shims.openai.choice import ChoiceOutput
from shims.openai.errors import OpenAIError
from shims.openai.out import ChoiceOut, chat_completion, usage
from shims.openai.params import output_constraint
from shims.openai.text import Vocabulary
from shims.openai.tool_calls import ToolMode, tool_definitions, tool_mode
from shims.openai.wire import ChatRequest, chat_messages, parse_request
from shims.responses.out import ResponseEvents, from_chat_completion
from shims.responses.wire import (
    chat_body,
    echoed_settings,
    ignored_fields,
    parse_responses_request,
    responses_error,
)
from tests.helpers import streamed_chat_chunks

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}', "status": "completed"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "London?"}]},
]


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> Vocabulary:
    return Vocabulary(AutoTokenizer.from_pretrained(tiny_model_dir))


def request(**fields):
    return parse_responses_request({"model": "m", "input": "hi", **fields})


# ---- requests -----------------------------------------------------------------------------------------------------
def test_a_conversation_becomes_the_chat_messages_the_template_renders(vocab):
    req = request(input=CONVERSATION, instructions="Be brief.", tools=[WEATHER], tool_choice="auto",
                  max_output_tokens=9, temperature=0.5, top_p=0.9, seed=3, top_k=4, store=True, whatever=1)
    body = chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And \nLondon?"},  # text parts joined with newlines, as vLLM joins them
    ]
    assert body["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert {k: body[k] for k in ("model", "max_completion_tokens", "temperature", "top_p", "tool_choice", "seed",
                                 "top_k")} == {"model": "m", "max_completion_tokens": 9, "temperature": 0.5,
                                               "top_p": 0.9, "tool_choice": "auto", "seed": 3, "top_k": 4}
    assert "stream" not in body and ignored_fields(req) == ["whatever"]  # vLLM's extensions are known fields
    # the chat layer takes the body as it takes a client's, and the template renders the call and its result
    chat = parse_request(ChatRequest, body)
    assert tool_mode(chat) == ToolMode("auto")
    prompt = vocab.decode(vocab.render_chat(chat_messages(chat.messages), tools=tool_definitions(chat)), False)
    assert "Be brief." in prompt and '"city": "Paris"' in prompt and "sunny" in prompt and "get_weather" in prompt


def test_consecutive_calls_join_one_assistant_turn_and_a_stream_asks_for_usage():
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(2)]
    body = chat_body(request(input=[{"role": "user", "content": "go"}, *calls], stream=True))
    assert body["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(2)]}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("fmt, response_format, constrained", [
    (None, None, False),
    ({"type": "text"}, None, False),
    ({"type": "json_object"}, {"type": "json_object"}, True),
    ({"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "city", "description": None, "schema": {"type": "object"},
                                             "strict": True}}, True),
])
def test_text_format_becomes_the_response_format_that_constrains_decoding(fmt, response_format, constrained):
    req = request(**({"text": {"format": fmt}} if fmt else {}))
    body = chat_body(req)
    assert body.get("response_format") == response_format
    assert (output_constraint(parse_request(ChatRequest, body), ToolMode()) is not None) == constrained
    assert echoed_settings(req)["text"] == {"format": fmt or {"type": "text"}}


def test_a_named_function_choice_becomes_the_chats_and_forces_its_arguments():
    req = request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    body = chat_body(req)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert tool_mode(parse_request(ChatRequest, body)) == ToolMode("named", "get_weather", WEATHER["parameters"])
    settings = echoed_settings(req)
    assert settings["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert settings["tools"] == [{"description": None, **WEATHER}] and settings["parallel_tool_calls"] is False


@pytest.mark.parametrize("fields, param, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "does not store responses"),
    ({"conversation": "conv_1"}, "conversation", "does not store responses"),
    ({"background": True}, "background", "not supported"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "'web_search'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search'"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "only text content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "does not store responses"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0]", "'reasoning'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "call_id"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs its schema"),
    ({"metadata": {"a": 1}}, "metadata.a", "invalid value"),
])
def test_what_this_server_cannot_do_is_refused_naming_the_parameter(fields, param, message):
    with pytest.raises(OpenAIError) as info:
        chat_body(request(**fields))
    assert info.value.status == 400 and info.value.param == param and message in info.value.message


def test_harmless_values_of_refused_fields_are_accepted():
    req = request(previous_response_id=None, background=False, conversation=None, store=True, include=["x"],
                  reasoning={"effort": "low"}, truncation="auto", service_tier="flex", metadata={"k": "v"})
    settings = echoed_settings(req)
    assert settings["store"] is False  # nothing is stored here, whatever was asked
    assert settings["reasoning"] == {"effort": "low", "summary": None} and settings["metadata"] == {"k": "v"}


def test_chat_errors_name_the_responses_parameter():
    schema = OpenAIError(400, "response_format.json_schema.schema: the JSON schema cannot be used: bad",
                         param="response_format.json_schema.schema")
    renamed = responses_error(schema)
    assert renamed.param == "text.format.schema"
    assert renamed.message == "text.format.schema: the JSON schema cannot be used: bad"
    other = OpenAIError(400, "temperature must be at least 0", param="temperature")
    assert responses_error(other) is other


# ---- sampled tokens → whole response and stream, the way the server makes them -------------------------------------
SETTINGS = echoed_settings(request(tools=[WEATHER], max_output_tokens=50))


def completion(vocab, tokens, tools, finish) -> dict:
    out = ChoiceOutput(vocab, [], tools)
    content, calls = out.push(tokens, final=True)
    choice = ChoiceOut(0, (content or None) if calls else content, out.finish_reason(finish), None, calls or None)
    return chat_completion(vocab, "chatcmpl-abc", 5, "m", [choice], usage(7, len(tokens)))


def sse_payloads(events: list[bytes]) -> list[dict]:
    payloads = []
    for sse in events:
        name, data = sse.decode().removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        payloads.append(payload)
    return payloads


def streamed(source) -> tuple[list[dict], list]:
    """The stream's events, each checked against the SDK's event types, and what the SDK's accumulator makes of
    them."""
    async def collect():
        return [event async for event in ResponseEvents(SETTINGS).translate(source)]

    events = sse_payloads(asyncio.run(collect()))
    state, seen = ResponseStreamState(input_tools=omit, text_format=omit), []
    for payload in events:
        seen += state.handle_event(TypeAdapter(ResponseStreamEvent).validate_python(payload))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, seen


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NAMED = ToolMode("named", "get_weather", WEATHER["parameters"])


@pytest.mark.parametrize("text, tools, finish, items, status", [
    ("Hello there, Paris is nice.", ToolMode(), "stop", ["message"], "completed"),
    ("Hello there", ToolMode(), "length", ["message"], "incomplete"),
    ("", ToolMode(), "stop", ["message"], "completed"),
    ("Sure." + CALL, ToolMode("auto"), "stop", ["message", "function_call"], "completed"),
    (CALL + CALL, ToolMode("auto"), "stop", ["function_call", "function_call"], "completed"),
    ('{"city": "Paris"}', NAMED, "stop", ["function_call"], "completed"),
    ('{"city": "Par', NAMED, "length", ["function_call"], "incomplete"),  # cut short: still the call, as in vLLM
])
def test_the_stream_adds_up_to_the_whole_response(vocab, text, tools, finish, items, status):
    tokens = vocab.encode(text) or [vocab.tokenizer.eos_token_id]
    chat = completion(vocab, tokens, tools, finish)
    whole = from_chat_completion(chat, SETTINGS)
    parsed = Response.model_validate(whole)
    assert (whole["id"], whole["created_at"], whole["model"], whole["status"]) == ("resp_abc", 5, "m", status)
    assert whole["incomplete_details"] == ({"reason": "max_output_tokens"} if status == "incomplete" else None)
    assert whole["usage"]["input_tokens"] == 7 and whole["usage"]["output_tokens"] == len(tokens)
    assert whole["usage"]["total_tokens"] == 7 + len(tokens)
    assert [item["type"] for item in whole["output"]] == items
    assert parsed.output_text == (chat["choices"][0]["message"]["content"] or "")
    calls = chat["choices"][0]["message"].get("tool_calls") or []
    assert [(i["call_id"], i["name"], i["arguments"]) for i in whole["output"] if i["type"] == "function_call"] == \
        [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert {k: whole[k] for k in SETTINGS} == SETTINGS

    events, seen = streamed(streamed_chat_chunks(vocab, tokens, tools, finish))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{status}"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(whole["output"])  # each answer draws its own ids
    assert {k: v for k, v in final.items() if k != "output"} == {k: v for k, v in whole.items() if k != "output"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == parsed.output_text
    if len(parsed.output_text) > 12 and tools.kind == "none":  # a forced call's JSON only means something whole
        assert kinds.count("response.output_text.delta") > 1, "text must arrive as it is sampled, not in one piece"
    # each item: added, its content, done, in output order, before the next item starts
    per_item = [(e["type"], e["output_index"]) for e in events if e["type"].startswith("response.output_item.")]
    assert per_item == [(kind, i) for i in range(len(items)) for kind in ("response.output_item.added",
                                                                          "response.output_item.done")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    for call in (e for e in events if e["type"] == "response.function_call_arguments.done"):
        assert call["arguments"] == done[call["output_index"]]["arguments"]
    end = seen[-1]  # the SDK's accumulator agrees on the items, and its final response is ours
    assert end.type == f"response.{status}" and end.response.output_text == parsed.output_text
    if status == "completed":
        assert [item.id for item in end.response.output] == [item["id"] for item in final["output"]]


def test_each_message_event_is_in_order_around_the_deltas(vocab):
    events, _ = streamed(streamed_chat_chunks(vocab, vocab.encode("Sure, it is sunny."), ToolMode(), "stop"))
    kinds = [e["type"] for e in events if e["type"] != "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    first_delta = next(i for i, e in enumerate(events) if e["type"] == "response.output_text.delta")
    assert events[first_delta - 1]["type"] == "response.content_part.added"
    item_id = events[2]["item"]["id"]
    assert item_id.startswith("msg_") and all(e["item_id"] == item_id for e in events if "item_id" in e)


def test_an_error_in_the_stream_ends_it_with_an_error_event():
    async def failing():
        yield {"id": "chatcmpl-abc", "created": 5, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]}
        yield OpenAIError(500, "the sampler died", kind="server_error").body()
        yield {"never": "read"}

    async def collect():
        return [event async for event in ResponseEvents(SETTINGS).translate(failing())]

    events = sse_payloads(asyncio.run(collect()))
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1] == {"type": "error", "code": None, "message": "the sampler died", "param": None,
                          "sequence_number": len(events) - 1}
    TypeAdapter(ResponseStreamEvent).validate_python(events[-1])
