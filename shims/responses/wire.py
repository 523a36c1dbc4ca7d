"""OpenAI ``/v1/responses`` request bodies → the chat-completions body the one sampling path already serves.

A Responses request is a chat request in other words: ``instructions`` is the system message, ``input`` the
conversation (messages, and the function calls and their outputs of earlier turns), ``max_output_tokens`` the
``max_completion_tokens``, ``text.format`` the ``response_format``, and the flat function tools the chat's nested
ones. Translating the body, rather than sampling a second way, keeps every chat rule (the chat template, tool-call
parsing, constrained output, the sampling checks) identical for both APIs.

This server keeps no responses, so what names stored state (``previous_response_id``, ``conversation``, a stored
``prompt``, ``background`` runs, ``item_reference`` inputs) is refused, saying so; fields that cannot change the
result (``store``, ``metadata``, ``include``, ``reasoning``…) are accepted. vLLM's sampling extensions (``top_k``,
``seed``, ``stop``…) pass through to the chat request, as vLLM's Responses route takes them. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from openai.types.shared import Reasoning
from pydantic import Field

from shims.lenient import Lenient
from shims.openai.errors import OpenAIError
from shims.openai.wire import parse_request

VLLM_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
                   "chat_template_kwargs", "structured_outputs")
"""vLLM's sampling fields on its Responses route; they keep their chat meaning (and the chat request's checks)."""

STATELESS = ("this server does not store responses: send the whole conversation in input (a response's output "
             "items can be passed back as input items as they are)")

REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((None,), STATELESS),
    "conversation": ((None,), STATELESS),
    "prompt": ((None,), "stored prompt templates are not supported by this server: send the prompt in input"),
    "background": ((None, False), ("background responses are not supported by this server: it does not store "
                                   "responses (use stream: true for a long response)")),
}
"""Fields whose other values need state this server does not keep: the values that leave the result unchanged, and
why the rest are refused."""


class ContentPart(Lenient):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


ITEMS: dict[str, type[Lenient]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                   "function_call_output": FunctionCallOutputItem}


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    """Optional when the server has one base model, as on the chat route."""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    """Checked one by one (``function_tools``), so that another kind of tool is refused by name."""
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    """Applies only to logprobs that ``include`` asks for, which this server leaves out (``include`` is ignored)."""
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None


def parse_responses_request(body: Any) -> ResponsesRequest:
    """The checked request: stored state refused, tools and ``tool_choice`` checked (their errors name the Responses
    parameter, not the chat one it becomes)."""
    if isinstance(body, dict):
        for name, (harmless, why) in REFUSED.items():
            if body.get(name) not in harmless:
                raise OpenAIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    req = parse_request(ResponsesRequest, body)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise OpenAIError(400, f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                          param="max_output_tokens", code="invalid_value")
    function_tools(req)
    tool_choice(req)
    return req


def ignored_fields(req: ResponsesRequest) -> list[str]:
    """Fields this server does not know (vLLM's extensions are known: they pass to the chat request)."""
    return sorted(set(req.model_extra or {}) - set(VLLM_EXTENSIONS))


def function_tools(req: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            raise OpenAIError(400, f"tools[{i}]: tools of type {tool.get('type')!r} are not supported by this server, "
                                   "only function tools ({type: 'function', name, parameters})", param=f"tools[{i}]")
        tools.append(parse_request(FunctionTool, tool))
    return tools


def tool_choice(req: ResponsesRequest) -> str | FunctionChoice | None:
    choice = req.tool_choice
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise OpenAIError(400, f"tool_choice of type {choice.get('type')!r} is not supported by this server: give "
                               "'auto', 'none', 'required' or {type: 'function', name}", param="tool_choice")
    return parse_request(FunctionChoice, choice)


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text") and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise OpenAIError(400, f"{param}[{j}]: only text content (input_text, output_text) is supported by this "
                                   f"server, got {part.type!r}", param=f"{param}[{j}]")
    return "\n".join(texts)  # as vLLM's chat parser joins a message's text parts


def _item(raw: dict[str, Any], i: int) -> Lenient:
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "item_reference":
        raise OpenAIError(400, f"input[{i}]: an item_reference needs stored items; {STATELESS}", param=f"input[{i}]")
    if kind not in ITEMS:
        raise OpenAIError(400, f"input[{i}]: input items of type {kind!r} are not supported by this server, only "
                               f"{', '.join(ITEMS)}", param=f"input[{i}]")
    try:
        return parse_request(ITEMS[kind], raw)
    except OpenAIError as exc:
        raise OpenAIError(400, f"input[{i}]: {exc.message}", param=f"input[{i}].{exc.param}", code=exc.code) from None


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The conversation as chat messages. Function calls join the assistant message before them (one assistant turn
    may write text and several calls), and each call's output is a ``tool`` message."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    if not req.input:
        raise OpenAIError(400, "input must not be empty", param="input")
    for i, item in enumerate(_item(raw, i) for i, raw in enumerate(req.input)):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content, f"input[{i}].content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input[{i}].output")})
    return messages


def _response_format(fmt: TextFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise OpenAIError(400, "text.format of type json_schema needs its schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "description": fmt.description,
                                                   "schema": fmt.json_schema, "strict": fmt.strict}}


def chat_body(req: ResponsesRequest) -> dict:
    """The chat-completions body that samples this request. A stream asks for the usage chunk, which the final
    ``response.completed`` event carries."""
    choice = tool_choice(req)
    body = {
        "model": req.model, "messages": chat_messages(req), "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "user": req.user,
        "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                  for tool in function_tools(req)] or None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionChoice) else choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text.format if req.text else None),
        **{name: value for name, value in (req.model_extra or {}).items() if name in VLLM_EXTENSIONS},
    }
    if req.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return {name: value for name, value in body.items() if value is not None}


def echoed_settings(req: ResponsesRequest) -> dict:
    """The request's settings as a Response states them, with OpenAI's defaults for those not given. ``store`` is
    false whatever was asked: nothing is stored here. Only fields this module checked are echoed: an unknown field
    the SDK's ``Response`` type knows (a tool's ``defer_loading``…) could fail its check once the answer is made."""
    fmt = req.text.format if req.text and req.text.format else TextFormat(type="text")
    fmt_fields = set(TextFormat.model_fields) - ({"name"} if fmt.type != "json_schema" else set())
    choice = tool_choice(req)
    return {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None,
                      **(req.reasoning.model_dump(mode="json", exclude_unset=True) if req.reasoning else {})},
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": fmt.model_dump(mode="json", by_alias=True, exclude_none=True, include=fmt_fields),
                 **({"verbosity": req.text.verbosity} if req.text and req.text.verbosity else {})},
        "tool_choice": choice.model_dump(mode="json", include=set(FunctionChoice.model_fields))
        if isinstance(choice, FunctionChoice) else choice or "auto",
        "tools": [tool.model_dump(mode="json", include=set(FunctionTool.model_fields)) for tool in function_tools(req)],
        "top_logprobs": req.top_logprobs or 0, "truncation": req.truncation or "disabled", "user": req.user,
        "background": False, "store": False,
    }



CHAT_PARAMS = {"response_format.json_schema.schema": "text.format.schema", "response_format.json_schema": "text.format",
               "response_format": "text.format", "messages": "input", "max_completion_tokens": "max_output_tokens"}
"""Chat parameters an error from the chat path may name, and the Responses parameter each came from."""


def responses_error(exc: OpenAIError) -> OpenAIError:
    """An error of the chat request this one became, naming the Responses parameters instead."""
    if exc.param not in CHAT_PARAMS:
        return exc
    ours = CHAT_PARAMS[exc.param]
    return OpenAIError(exc.status, exc.message.replace(exc.param, ours, 1), param=ours, code=exc.code,
                       kind=exc.kind)
