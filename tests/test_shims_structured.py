"""shims.openai.tool_calls, shims.sampling.json_schema_limits and the output constraint of shims.openai.params: what
``tool_choice`` and ``response_format`` ask for, which schemas constrained decoding can enforce, and the model's ``<tool_call>``
blocks parsed into OpenAI ``tool_calls``, whole and streamed alike."""

from __future__ import annotations

import json

import jsonschema
import pytest

from shims.openai.errors import OpenAIError
from shims.openai.params import output_constraint
from shims.openai.tool_calls import ToolCallStream, constrained_calls, parse_tool_calls, tool_mode
from shims.openai.wire import ChatRequest, CompletionRequest, parse_request
from shims.sampling.json_schema_limits import admits_nothing, unsupported_features

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields) -> ChatRequest:
    return parse_request(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def without_ids(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- which schemas constrained decoding can enforce -------------------------------------------------------------

@pytest.mark.parametrize("schema, found", [
    ({"type": "integer", "multipleOf": 5}, ["multipleOf at the root"]),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     ["uniqueItems at properties.tags"]),
    ({"type": "array", "items": {"type": "number"}, "contains": {"const": 1}, "maxContains": 2},
     ["contains at the root", "maxContains at the root"]),
    ({"type": "string", "format": "credit-card"}, ["format 'credit-card' at the root"]),
    ({"type": "string", "pattern": "^a+$", "maxLength": 4}, ["minLength/maxLength with a pattern or format at the root"]),
    ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, ["allOf with more than one branch at the root"]),
    ({"type": "object", "propertyNames": {"pattern": "^x"}, "properties": {"x": {}}},
     ["propertyNames with properties, patternProperties, unevaluatedProperties or a bounded pattern at the root"]),
    ({"type": "object", "patternProperties": {"^a": {}, "^b": {}}},
     ["patternProperties with properties, or more than one pattern at the root"]),
    ({"anyOf": [{"type": ["integer", "null"], "multipleOf": 2}]}, ["multipleOf at anyOf.0"]),
    ({"properties": {"n": {"multipleOf": 3}}}, ["multipleOf at properties.n"]),  # no type: not enforced either
    ({"$defs": {"Tags": {"type": "array", "uniqueItems": True}}, "items": {"$ref": "#/$defs/Tags"}},
     ["uniqueItems at $defs.Tags"]),
])
def test_features_xgrammar_would_ignore_are_named_with_where_they_are(schema, found):
    assert unsupported_features(schema) == found


def test_what_xgrammar_enforces_passes():
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "when", "scores"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "when": {"type": "string", "format": "date-time"},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": 3},
        "kind": {"enum": ["a", "b"]}, "only": {"allOf": [{"type": "string"}]},
        "extra": {"type": "object", "patternProperties": {"^x": {"type": "number"}}},
        "$defs": {"type": "object"}}}
    assert unsupported_features(schema) == []
    data_not_schemas = {"type": "object", "properties": {
        "type": {"type": "string"}, "allOf": {"type": "integer"}, "format": {"type": "string"},
        "n": {"type": "integer", "default": {"type": "integer", "multipleOf": 2}},
        "tags": {"enum": [{"type": "array", "uniqueItems": True}], "examples": [{"format": "phone"}]}}}
    assert unsupported_features(data_not_schemas) == []
    assert unsupported_features(True) == [] and unsupported_features({}) == []


# ---- schemas that admit no finite value ---------------------------------------------------------------------------

NODE = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#/$defs/Node"}}}


@pytest.mark.parametrize("schema, named", [
    ({"$ref": "#"}, "the root"),
    ({"anyOf": [{"$ref": "#"}], "description": "a recursion through anyOf"}, "the root"),
    ({"$ref": "#/$defs/Tree", "$defs": {"Tree": {"anyOf": [{"$ref": "#/$defs/Branch"}]},
                                        "Branch": {"$ref": "#/$defs/Tree"}}}, "$defs.Tree, $defs.Branch"),
    ({"type": "object", "required": ["head"], "properties": {"head": {"$ref": "#/$defs/Node"}},
      "$defs": {"Node": {**NODE, "required": ["next"]}}}, "$defs.Node"),
    ({"type": "object", "required": ["kids"], "properties": {"kids": {"type": "array", "items": {"$ref": "#"},
                                                                      "minItems": 1}}}, "the root"),
    ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, "the root"),
    ({"$ref": "#/definitions/a~1b%20c", "definitions": {"a/b c": {"allOf": [{"$ref": "#/definitions/a~1b%20c"}]}}},
     "definitions.a/b c"),
])
def test_a_recursion_with_no_base_case_is_named(schema, named):
    assert admits_nothing(schema) == (f"admits no finite value: {named} can only be satisfied by a value that "
                                      f"contains another such value, without end (a $ref recursion with no base case)")


@pytest.mark.parametrize("schema, finite", [
    ({"type": "object", "required": ["kids"], "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
     {"kids": [{"kids": []}]}),
    ({"anyOf": [{"type": "null"}, {"$ref": "#"}]}, None),
    ({"type": "object", "required": ["head"], "properties": {"head": {"$ref": "#/$defs/Node"}},
      "$defs": {"Node": NODE}}, {"head": {"value": 1, "next": {"value": 2}}}),
    ({"type": ["object", "null"], "required": ["a"], "properties": {"a": {"$ref": "#"}}}, {"a": None}),
    ({"required": ["a"], "properties": {"a": {"$ref": "#"}}}, 3),  # no type given: a number is not an object
    ({"type": "object", "properties": {"loop": {"$ref": "#/$defs/Loop"}}, "$defs": {"Loop": {"$ref": "#/$defs/Loop"}}},
     {}),  # the endless part is optional
    ({}, []),
])
def test_a_recursion_with_a_base_case_passes(schema, finite):
    assert admits_nothing(schema) is None
    jsonschema.validate(finite, schema)  # and here is a finite value it admits


def test_a_reference_that_cannot_be_followed_is_not_called_empty():
    for ref in ("#/$defs/Missing", "#/properties/0", "https://example.com/schema.json", "#anchor"):
        schema = {"$ref": ref, "type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
        assert admits_nothing(schema) is None


def test_a_schema_that_admits_nothing_is_a_400_naming_its_parameter():
    for fields, param in [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#"}}}},
             "response_format.json_schema.schema"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
              "tool_choice": "required"}, "tools.0.function.parameters"),
            ({"guided_json": {"$ref": "#"}}, "guided_json")]:
        req = chat(**fields)
        with pytest.raises(OpenAIError) as info:
            output_constraint(req, tool_mode(req))
        assert info.value.status == 400 and info.value.param == param
        assert info.value.message == f"{param}: the JSON schema admits no finite value: the root can only be " \
                                     f"satisfied by a value that contains another such value, without end (a $ref " \
                                     f"recursion with no base case)"


# ---- response_format, structured_outputs, guided_json → the output constraint ----------------------------------

def test_each_way_of_asking_for_json_becomes_one_constraint():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    none = tool_mode(chat())
    assert output_constraint(chat(), none) is None
    assert output_constraint(chat(response_format={"type": "text"}), none) is None
    assert output_constraint(chat(response_format={"type": "json_object"}), none).json_schema is None
    by_format = output_constraint(chat(response_format={"type": "json_schema",
                                                        "json_schema": {"name": "n", "schema": schema}}), none)
    assert json.loads(by_format.json_schema) == schema
    completion = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "structured_outputs": {"json": schema}})
    assert json.loads(output_constraint(completion, none).json_schema) == schema
    assert json.loads(output_constraint(chat(guided_json=schema), none).json_schema) == schema
    forced = tool_mode(chat(tools=[WEATHER], tool_choice="required"))
    assert json.loads(output_constraint(chat(response_format={"type": "json_object"}), forced).json_schema) == \
        forced.schema  # a forced call's JSON wins over response_format


@pytest.mark.parametrize("fields, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}},
     "response_format.json_schema.schema", "could not be guaranteed to follow it: multipleOf at properties.n"),
    ({"guided_json": {"type": "nope"}}, "guided_json", "the JSON schema cannot be used"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema",
     "needs json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "response_format", "give one of"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "only json and json_object"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}], "tool_choice": "required"},
     "tools.1.function.parameters", "follow it: multipleOf at properties.n"),
])
def test_a_constraint_that_cannot_be_honoured_is_a_400_naming_its_parameter(fields, param, fragment):
    req = chat(**fields)
    with pytest.raises(OpenAIError) as info:
        output_constraint(req, tool_mode(req))
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message


# ---- tool_choice ---------------------------------------------------------------------------------------------------

def test_tool_choice_modes_and_the_schemas_they_constrain_to():
    assert tool_mode(chat()).kind == "none" and tool_mode(chat(tools=[WEATHER], tool_choice="none")).kind == "none"
    assert tool_mode(chat(tools=[WEATHER])).kind == "auto"
    named = tool_mode(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (named.kind, named.name, named.schema) == ("named", "get_time", {"type": "object", "properties": {}})
    required = tool_mode(chat(tools=[WEATHER, TIME], tool_choice="required"))
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, required.schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "launch", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required.schema)
    single = tool_mode(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    jsonschema.validate(good[:1], single.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single.schema)
    assert without_ids(constrained_calls(required, json.dumps(good))) == [("get_weather", {"city": "Paris"}),
                                                                          ("get_time", {})]
    assert without_ids(constrained_calls(named, "{}")) == [("get_time", {})]
    assert constrained_calls(required, '[{"name": "get_time", "param') == []  # cut short by max_tokens


def test_a_named_call_cut_short_by_max_tokens_is_still_the_call_whole_and_streamed(tiny_model_dir):
    """As vLLM answers a named ``tool_choice`` however the text ends: the call, its arguments the text as far as it
    got, and no content; only a blank text is no call (and empty content). The sampler's finish_reason stays."""
    from transformers import AutoTokenizer

    from shims.openai.choice import ChoiceOutput
    from shims.openai.text import Vocabulary

    vocab = Vocabulary(AutoTokenizer.from_pretrained(tiny_model_dir))
    named = tool_mode(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    for text, calls in (('{"city": "Par', [("get_weather", '{"city": "Par')]), (" ", [])):
        tokens = vocab.encode(text)
        whole = ChoiceOutput(vocab, (), named)
        content, whole_made = whole.push(tokens, final=True)
        streamed, streamed_content, streamed_made = ChoiceOutput(vocab, (), named), "", []
        for i, token in enumerate(tokens):
            delta, new = streamed.push([token], final=i == len(tokens) - 1)
            streamed_content, streamed_made = streamed_content + delta, streamed_made + new
        assert content == streamed_content == ""
        for out, made in ((whole, whole_made), (streamed, streamed_made)):
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in made] == calls
            assert out.finish_reason("length") == "length"


@pytest.mark.parametrize("fields, fragment", [
    ({"tool_choice": "required"}, "tool_choice requires tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "not among the tools (get_weather)"),
])
def test_tool_choice_that_cannot_be_met_is_a_400(fields, fragment):
    with pytest.raises(OpenAIError) as info:
        tool_mode(chat(**fields))
    assert info.value.status == 400 and info.value.param == "tool_choice" and fragment in info.value.message


# ---- the model's <tool_call> blocks → tool_calls, whole and streamed -------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "No tools needed.",
    CALL,
    "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "London"),
    '<tool_call>{"name": "get_time", "parameters": {}}',  # cut before its closing tag, yet whole
    "Half <tool_call>{not json}</tool_call>",  # does not parse: all of it stays text
    "a < b, and <tool_ is not a tag",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_calls_and_content_add_up_to_the_whole_response_at_every_split(text):
    whole_content, whole_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        for second in (cut, min(len(text), cut + 7)):
            stream, content, calls = ToolCallStream(), "", []
            for piece, final in ((text[:cut], False), (text[cut:second], False), (text[second:], True)):
                delta, new = stream.push(piece, final=final)
                content += delta
                calls += new
            assert content == (whole_content or "") and without_ids(calls) == without_ids(whole_calls), (cut, second)


def test_whole_responses_parse_as_vllms_hermes_parser_does():
    assert parse_tool_calls(TEXTS[0]) == (TEXTS[0], [])
    content, calls = parse_tool_calls(TEXTS[2])
    assert content == "Let me check.\n"
    assert without_ids(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("chatcmpl-tool-")
    assert parse_tool_calls(TEXTS[1])[0] is None  # nothing before the call: content is null, as OpenAI sends it
    assert without_ids(parse_tool_calls(TEXTS[3])[1]) == [("get_time", {})]
    assert parse_tool_calls(TEXTS[4]) == (TEXTS[4], [])
