"""Function calling in the chat template's own format (Qwen3 / hermes): ``tool_choice`` → what to parse or constrain,
and the model's ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks → OpenAI ``tool_calls``, whole or
streamed.

As vLLM's server does: ``auto`` parses whatever calls the model chose to write; ``required`` and a named function
constrain the output to JSON (a list of ``{"name", "parameters"}``, or the named function's arguments), so a call
always comes back and, unless ``max_tokens`` cuts it short, parses. Pure: nothing here does I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shims.openai.errors import OpenAIError
from shims.openai.wire import ChatRequest, NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """What the response does with tools: ``none`` (plain text), ``auto`` (parse calls the model writes),
    ``required`` (constrained list of calls) or ``named`` (constrained arguments of ``name``)."""

    kind: str = "none"
    name: str | None = None
    schema: dict | None = None
    """The JSON schema the output is constrained to (``required`` and ``named``)."""


def tool_definitions(req: ChatRequest) -> list[dict] | None:
    """The tools as the chat template receives them (OpenAI's own dict shape)."""
    if not req.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


def tool_mode(req: ChatRequest) -> ToolMode:
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice not in ("none", "auto"):
            raise OpenAIError(400, "tool_choice requires tools: list the functions the model may call",
                              param="tool_choice")
        return ToolMode()
    if choice == "none":
        return ToolMode()
    if choice is None or choice == "auto":
        return ToolMode("auto")
    parameters = {tool.function.name: tool.function.parameters or {"type": "object", "properties": {}}
                  for tool in req.tools}
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in parameters:
            raise OpenAIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                   f"({', '.join(parameters)})", param="tool_choice")
        return ToolMode("named", choice.function.name, parameters[choice.function.name])
    calls = {"type": "array", "minItems": 1,
             "items": {"anyOf": [{"type": "object", "required": ["name", "parameters"],
                                  "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema}}
                                 for name, schema in parameters.items()]}}
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolMode("required", schema=calls)


def _call(name: str, arguments: object) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": text}}


def _parse_block(raw: str) -> dict | None:
    try:
        obj = json.loads(raw.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole ``auto`` response. Content is the text before the first ``<tool_call>``; if
    any block does not parse, nothing is a call and the whole text is the content (the caller sees what the model
    wrote rather than losing it)."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = [_parse_block(m.group(1) if m.group(1) is not None else m.group(2)) for m in _BLOCK.finditer(text)]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:start] or None, calls


def constrained_calls(mode: ToolMode, text: str) -> list[dict]:
    """The calls in a ``required`` / ``named`` response, which the constraint made valid JSON. A response cut short by
    ``max_tokens`` may not be: a named function's call still comes back, its arguments the text as far as it got (as
    vLLM answers; only a blank text is no call), while a ``required`` list that does not parse has no calls and keeps
    its text as content."""
    if mode.kind == "named":
        return [_call(mode.name, text)] if text.strip() else []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [_call(c["name"], c.get("parameters", {})) for c in value if isinstance(c, dict) and "name" in c]


class ToolCallStream:
    """An ``auto`` response streamed: content deltas up to the first ``<tool_call>`` (holding back a tail that may be
    the start of one), then each call once its block has closed. Concatenated, the deltas equal
    ``parse_tool_calls`` of the whole text."""

    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.calls_sent = 0

    def push(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """Add text; returns (content delta, newly complete calls)."""
        self.text += delta
        start = self.text.find(OPEN)
        if start < 0:
            upto = len(self.text)
            if not final:
                upto -= next((n for n in range(min(len(OPEN) - 1, len(self.text)), 0, -1)
                              if OPEN.startswith(self.text[-n:])), 0)
            content, self.content_sent = self.text[self.content_sent:upto], upto
            return content, []
        if final:
            _, calls = parse_tool_calls(self.text)
            if not calls and self.calls_sent == 0:  # nothing parsed: the rest is text, as in the whole response
                content, self.content_sent = self.text[self.content_sent:], len(self.text)
                return content, []
            content, self.content_sent = self.text[self.content_sent:start], start
            new, self.calls_sent = calls[self.calls_sent:], len(calls)
            return content, new
        content, self.content_sent = self.text[self.content_sent:start], start
        closed = [m.group(1) for m in re.finditer(r"<tool_call>(.*?)</tool_call>", self.text, re.DOTALL)]
        new = [c for c in (_parse_block(raw) for raw in closed[self.calls_sent:]) if c is not None]
        if len(new) < len(closed) - self.calls_sent:  # a block that does not parse: decided at the end
            return content, []
        self.calls_sent = len(closed)
        return content, new
