"""Anthropic ``/v1/messages`` and ``/v1/messages/count_tokens`` request bodies, parsed into typed requests and
translated into the OpenAI chat-completions body the one sampler path (``CompletionsService``) already takes.

What Anthropic's request says and OpenAI's chat says alike goes across field by field: ``system`` becomes a system
message, an assistant's ``tool_use`` blocks its ``tool_calls``, a user's ``tool_result`` blocks ``tool`` messages,
``stop_sequences`` the ``stop`` strings. As on the OpenAI routes (and vLLM's Anthropic route), a field this server
does not know is accepted and ignored (the response names it in ``X-Ignored-Fields``); one that would change the
result and that this server cannot honour (extended thinking) is refused. Pure: nothing here does I/O.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from shims.lenient import Lenient
from shims.openai.errors import OpenAIError

_R = TypeVar("_R", bound=BaseModel)
_UNION_BRANCH = re.compile(r"\[|^function-|^(str|int|float|bool)$")
"""Parts of a pydantic error location that name a union branch (``list[…]``, ``str``) rather than a field."""


class TextBlock(Lenient):
    """Other fields (``cache_control``, ``citations``) are accepted and have no effect here."""

    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    """``is_error`` is accepted, as vLLM does; a chat template has no place for it (the content says what failed)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Lenient):
    """A client tool; Anthropic's server tools (web search, code execution…) have no ``input_schema`` and are
    refused by its absence."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]


class JsonFormat(Lenient):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    """``effort`` is accepted and has no effect: the served models have no effort setting."""

    format: JsonFormat | None = None


class CountTokensRequest(Lenient):
    """What shapes the prompt: ``count_tokens`` takes this much, ``/v1/messages`` more."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None


def parse_request(model: type[_R], body: object) -> _R:
    """Validate a JSON body; a problem becomes a 400 naming where it is, as Anthropic's do
    (``messages.0.content.1.id: Field required``)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # Of a union's failed branches, the one that got furthest says what is wrong (a block's missing field
        # rather than "content should be a string")
        error = max(exc.errors(), key=lambda e: len(e["loc"]))
        where = _where(error["loc"])
        if error["type"] == "union_tag_invalid":
            tag = error["ctx"]["tag"]
            raise OpenAIError(400, f"{where}: content blocks of type {tag!r} are not supported by this server (it "
                                   "takes text, tool_use and tool_result blocks)", param=where) from None
        raise OpenAIError(400, f"{where}: {error['msg']}", param=where) from None


def _where(loc: tuple) -> str:
    """A pydantic error location as Anthropic writes it (``messages.0.content.1.id``), without the union branches
    pydantic names on the way (``str``, ``list[…]``, and the block type a tagged union picked)."""
    kept = []
    for i, part in enumerate(loc):
        picked_tag = i >= 2 and isinstance(loc[i - 1], int) and "tagged-union" in str(loc[i - 2])
        if not (picked_tag or _UNION_BRANCH.search(str(part))):
            kept.append(str(part))
    return ".".join(kept)


def ignored_fields(req: BaseModel) -> list[str]:
    """The request's top-level fields this server does not know: accepted, and ignored (``metadata`` among them)."""
    return sorted(req.model_extra or {})


def _parts(blocks: list[TextBlock]) -> list[dict]:
    return [{"type": "text", "text": block.text} for block in blocks]


Placed = tuple[str, Block]
"""A content block with where it stood in the request (``messages.1.content.0``), for error messages."""


def _user_messages(blocks: list[Placed]) -> list[dict]:
    """A user turn's blocks in order: runs of text as user messages, each tool result as a ``tool`` message."""
    out, text = [], []
    for where, block in blocks:
        if isinstance(block, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": _parts(text)})
                text = []
            content = block.content if isinstance(block.content, str) else _parts(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, TextBlock):
            text.append(block)
        else:
            raise OpenAIError(400, f"{where}: tool_use blocks belong in assistant turns", param=where)
    if text or not out:
        out.append({"role": "user", "content": _parts(text)})
    return out


def _assistant_message(blocks: list[Placed]) -> dict:
    """An assistant turn: its text, and its ``tool_use`` blocks as OpenAI tool calls (JSON arguments)."""
    text, calls = [], []
    for where, block in blocks:
        if isinstance(block, ToolResultBlock):
            raise OpenAIError(400, f"{where}: tool_result blocks belong in user turns", param=where)
        if isinstance(block, TextBlock):
            text.append(block)
        else:
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    return {"role": "assistant", "content": _parts(text) if text or not calls else None,
            **({"tool_calls": calls} if calls else {})}


def _turns(messages: list[Message]) -> list[tuple[str, str | list[Placed]]]:
    """The conversation's turns. As Anthropic's API does, consecutive messages of one role are one turn (their
    blocks in order); a lone message with string content stays a string, so it renders exactly as sent."""
    turns: list[tuple[str, str | list[Placed]]] = []
    for n, message in enumerate(messages):
        content = message.content
        blocks = ([(f"messages.{n}.content", TextBlock(type="text", text=content))] if isinstance(content, str)
                  else [(f"messages.{n}.content.{i}", block) for i, block in enumerate(content)])
        if turns and turns[-1][0] == message.role:
            previous = turns[-1][1]
            if isinstance(previous, str):
                previous = [(f"messages.{n - 1}.content", TextBlock(type="text", text=previous))]
            turns[-1] = (message.role, previous + blocks)
        else:
            turns.append((message.role, content if isinstance(content, str) else blocks))
    return turns


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """The conversation as OpenAI chat messages, ``system`` first."""
    out = []
    if req.system:
        # vLLM's Anthropic route joins the system blocks with nothing between them (a message's text parts: newlines)
        system = req.system if isinstance(req.system, str) else "".join(block.text for block in req.system)
        out.append({"role": "system", "content": system})
    for role, content in _turns(req.messages):
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "user":
            out.extend(_user_messages(content))
        else:
            out.append(_assistant_message(content))
    return out


def _tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError(400, "tool_choice.name: required when tool_choice.type is 'tool'", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def prompt_body(req: CountTokensRequest) -> dict:
    """The OpenAI chat body of everything that shapes the prompt (and, for forced tools or a JSON format, the
    output's constraint): what ``count_tokens`` renders, and the start of every ``/v1/messages`` body."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise OpenAIError(400, f"thinking: type {req.thinking.type!r} is not supported by this server (the served "
                               "models' reasoning is not parsed out); leave thinking out or disable it",
                          param="thinking")
    messages = chat_messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if messages and messages[-1]["role"] == "assistant":  # Anthropic's prefill: the reply continues this turn
        body.update(add_generation_prompt=False, continue_final_message=True)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {})}} for tool in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": req.output_config.format.json_schema}}
    return body


def chat_body(req: MessagesRequest) -> dict:
    """The OpenAI chat-completions body that samples what ``req`` asks for. The stop string that ended the text is
    kept in it (``include_stop_str_in_output``): that is how the answer tells which of ``stop_sequences`` fired
    (``shims.anthropic.out`` takes it off again); a stream asks for the usage chunk, whose count ``message_delta``
    gives."""
    body = prompt_body(req)
    body.update(max_tokens=req.max_tokens, include_stop_str_in_output=True)
    sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences}
    body.update({name: value for name, value in sampling.items() if value is not None})
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body
