"""shims.anthropic.wire and shims.anthropic.out: Anthropic requests → OpenAI chat bodies (checked by the OpenAI layer
and rendered by the tiny model's template), chat completions → Anthropic messages, and streams that add up to the
whole message as the ``anthropic`` SDK's own accumulator reads them."""

from __future__ import annotations

import asyncio
import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from shims.anthropic.out import MessageStream, ending, error_body, message, split_stop
from shims.anthropic.wire import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
    ignored_fields,
    parse_request,
    prompt_body,
)
from shims.openai.choice import ChoiceOutput
from shims.openai.errors import OpenAIError
from shims.openai.out import ChoiceOut, chat_completion, usage
from shims.openai.text import Vocabulary
from shims.openai.tool_calls import ToolMode, tool_definitions, tool_mode
from shims.openai.wire import ChatRequest, chat_messages
from shims.openai.wire import parse_request as parse_openai
from tests.helpers import streamed_chat_chunks

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                 {"type": "text", "text": "And London?", "cache_control": {"type": "ephemeral"}}]},
]


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> Vocabulary:
    return Vocabulary(AutoTokenizer.from_pretrained(tiny_model_dir))


def messages_request(**fields) -> MessagesRequest:
    return parse_request(MessagesRequest, {"model": "m", "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_conversation_with_tools_becomes_the_openai_chat_the_template_renders_alike(vocab):
    req = messages_request(system=[{"type": "text", "text": "Be brief."}], messages=CONVERSATION, tools=[WEATHER],
                           tool_choice={"type": "auto"}, stop_sequences=["\n\n"], temperature=0.5, top_k=3,
                           metadata={"user_id": "u"})
    assert ignored_fields(req) == ["metadata"]
    body = chat_body(req)
    openai = parse_openai(ChatRequest, body)  # the OpenAI layer takes it as it is
    assert not openai.model_extra and openai.tool_choice == "auto" and openai.stop == ["\n\n"]
    assert (openai.max_tokens, openai.temperature, openai.top_k, openai.include_stop_str_in_output) == (8, 0.5, 3, True)
    by_hand = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And London?"},
    ]
    assert chat_messages(openai.messages) == by_hand
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": WEATHER["input_schema"]}}]
    assert tool_definitions(openai) == tools
    expected = vocab.tokenizer.apply_chat_template(by_hand, tools=tools, add_generation_prompt=True, tokenize=True)
    assert vocab.render_chat(chat_messages(openai.messages), tools=tool_definitions(openai)) == \
        list(expected["input_ids"])
    assert "<tool_response>\nsunny\n</tool_response>" in vocab.decode(expected["input_ids"])


def test_consecutive_turns_of_one_role_are_one_turn_as_anthropic_combines_them():
    """A turn's text blocks join with newlines (vLLM's chat parser), its system blocks with nothing (vLLM's
    Anthropic route)."""
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "user", "content": [{"type": "text", "text": "And London?"}]},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "assistant", "content": "Also:"},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
             {"role": "user", "content": "Thanks"}]
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    openai = parse_openai(ChatRequest, chat_body(messages_request(messages=turns, tools=[WEATHER], system=system)))
    assert chat_messages(openai.messages) == [
        {"role": "system", "content": "Be brief."},  # system blocks joined as vLLM's Anthropic route joins them
        {"role": "user", "content": "Weather in Paris?\nAnd London?"},
        {"role": "assistant", "content": "Also:", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    with pytest.raises(OpenAIError) as info:  # a misplaced block is named where the client put it
        chat_body(messages_request(messages=[turns[0], {"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]))
    assert info.value.message.startswith("messages.1.content.1: tool_use blocks belong in assistant turns")


@pytest.mark.parametrize("choice, openai_choice, mode", [
    ({"type": "auto"}, "auto", "auto"), ({"type": "any"}, "required", "required"), ({"type": "none"}, "none", "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, "named"),
])
def test_tool_choice_maps_onto_openais(choice, openai_choice, mode):
    body = chat_body(messages_request(tools=[WEATHER], tool_choice=choice))
    assert body["tool_choice"] == openai_choice
    assert tool_mode(parse_openai(ChatRequest, body)).kind == mode
    single = chat_body(messages_request(tools=[WEATHER], tool_choice={**choice, "disable_parallel_tool_use": True}))
    assert single["parallel_tool_calls"] is False


def test_stream_prefill_format_and_what_count_tokens_renders():
    streamed = chat_body(messages_request(stream=True))
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    assert "stream" not in chat_body(messages_request())
    prefilled = chat_body(messages_request(messages=[{"role": "user", "content": "Name a city"},
                                                     {"role": "assistant", "content": "The city is"}]))
    assert prefilled["continue_final_message"] is True and prefilled["add_generation_prompt"] is False
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formatted = chat_body(messages_request(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert parse_openai(ChatRequest, formatted).response_format.json_schema.json_schema == schema
    counted = prompt_body(parse_request(CountTokensRequest, {"model": "m", "system": "s",
                                                             "messages": [{"role": "user", "content": "hi"}]}))
    assert counted == {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fields, where", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
     "messages.0.content.0.id"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
])
def test_malformed_requests_say_where(fields, where):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(OpenAIError) as info:
        parse_request(MessagesRequest, {k: v for k, v in body.items() if v is not None})
    assert info.value.status == 400 and info.value.message.startswith(f"{where}: ")


@pytest.mark.parametrize("fields, fragment", [
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "tool_use blocks belong in assistant turns"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "tool_result blocks belong in user turns"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_requests_this_server_cannot_honour_are_refused(fields, fragment):
    with pytest.raises(OpenAIError) as info:
        chat_body(messages_request(**fields))
    assert info.value.status == 400 and fragment in info.value.message
    assert chat_body(messages_request(thinking={"type": "disabled"}))  # disabled thinking is what happens anyway


def test_error_bodies_take_anthropics_type_for_the_status():
    kinds = {status: error_body(status, "m")["error"]["type"] for status in (400, 401, 404, 405, 429, 500, 503)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                     405: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "api_error"}
    assert error_body(404, "no such model") == {"type": "error",
                                                "error": {"type": "not_found_error", "message": "no such model"}}


def test_a_stop_sequence_is_named_only_when_it_is_the_stop_reason():
    assert ending("stop", False, "##") == {"stop_reason": "stop_sequence", "stop_sequence": "##"}
    assert ending("length", False, "##") == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert ending("stop", True, "##") == {"stop_reason": "tool_use", "stop_sequence": None}
    assert ending("stop", False, None) == {"stop_reason": "end_turn", "stop_sequence": None}


def test_split_stop_takes_the_first_stop_string_in_the_text():
    assert split_stop("abc STOP", ["STOP", "zz"]) == ("abc ", "STOP")
    assert split_stop("abc", ["STOP"]) == ("abc", None)
    assert split_stop("x ab", ["b", "ab"]) == ("x ", "ab")  # the one that starts first
    assert split_stop("x ab", ["ab", "a"]) == ("x ", "a")  # of two starting together, the shorter


# ---- sampled tokens → whole message and stream, the same way the server makes them --------------------------------
def completion(vocab, tokens, stops, tools, finish) -> dict:
    out = ChoiceOutput(vocab, stops, tools, include_stop=True)
    content, calls = out.push(tokens, final=True)
    choice = ChoiceOut(0, (content or None) if calls else content, out.finish_reason(finish), None, calls or None)
    return chat_completion(vocab, "chatcmpl-abc", 0, "m", [choice], usage(7, len(tokens)))


def streamed(vocab, tokens, stops, tools, finish) -> tuple[list[dict], dict]:
    """The stream's events, each checked against the SDK's event types, and the message the SDK builds of them."""
    async def collect():
        raw = MessageStream(stops, 7).translate(streamed_chat_chunks(vocab, tokens, tools, finish, stops, include_stop=True))
        return [event async for event in raw]

    events, snapshot, buffers = [], None, {}
    for sse in asyncio.run(collect()):
        name, data = sse.decode().removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        TypeAdapter(RawMessageStreamEvent).validate_python(payload)
        events.append(payload)
        snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=buffers)
    return events, snapshot.to_dict()


def without_ids(content: list[dict]) -> list[dict]:
    return [{key: value for key, value in block.items() if key != "id"} for block in content]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text, stops, tools, finish, content, reason, stop", [
    ("Hello there, Paris is nice.", [], ToolMode(), "stop", "Hello there, Paris is nice.", "end_turn", None),
    ("Hello there, Paris is nice.", ["zzz", "re, Pa", "nice"], ToolMode(), "stop", "Hello the", "stop_sequence",
     "re, Pa"),
    ("Hello there", [], ToolMode(), "length", "Hello there", "max_tokens", None),
    ("", [], ToolMode(), "stop", "", "end_turn", None),
    ("Sure." + CALL, [], ToolMode("auto"), "stop", "Sure.", "tool_use", None),
    ('{"city": "Paris"}', [], ToolMode("named", "get_weather", WEATHER["input_schema"]), "stop", "", "tool_use",
     None),
])
def test_the_stream_adds_up_to_the_whole_message(vocab, text, stops, tools, finish, content, reason, stop):
    tokens = vocab.encode(text) or [vocab.tokenizer.eos_token_id]
    whole = message(completion(vocab, tokens, stops, tools, finish), stops)
    Message.model_validate(whole)
    assert whole["id"] == "msg_abc" and whole["stop_reason"] == reason and whole["stop_sequence"] == stop
    assert whole["usage"] == {"input_tokens": 7, "output_tokens": len(tokens)}
    texts = [block["text"] for block in whole["content"] if block["type"] == "text"]
    assert "".join(texts) == content and len(texts) == (1 if content or tools.kind == "none" else 0)
    uses = [block for block in whole["content"] if block["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == ([("get_weather", {"city": "Paris"})] if reason == "tool_use"
                                                      else [])
    assert all(u["id"].startswith("toolu_") for u in uses)

    events, built = streamed(vocab, tokens, stops, tools, finish)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    assert starts == list(range(len(whole["content"])))
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == starts
    if len(content) > 12:
        assert kinds.count("content_block_delta") > 1, "text must arrive as it is sampled, not in one piece"
    assert without_ids(built["content"]) == without_ids(whole["content"])  # each answer draws its own call ids
    assert {k: built[k] for k in ("id", "model", "stop_reason", "stop_sequence", "usage")} == \
        {k: whole[k] for k in ("id", "model", "stop_reason", "stop_sequence", "usage")}


def test_an_error_in_the_stream_ends_it_as_an_anthropic_error_event():
    async def failing():
        yield {"id": "chatcmpl-abc", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                                "finish_reason": None}]}
        yield OpenAIError(500, "the sampler died", kind="server_error").body()
        yield {"never": "read"}

    async def collect():
        return [event async for event in MessageStream([], 3).translate(failing())]

    events = asyncio.run(collect())
    assert events[0].startswith(b"event: message_start\n")
    assert events[-1] == b'event: error\ndata: {"type":"error","error":{"type":"api_error",' \
                         b'"message":"the sampler died"}}\n\n'
