"""OpenAI chat completions → Anthropic's answers: the whole ``message``, the streamed events, and error bodies.

The sampler path answers in OpenAI's shapes; this re-shapes them. Anthropic says which stop sequence ended the text,
which OpenAI's ``finish_reason: stop`` does not: the chat request asks for the stop string to be kept in the text
(``shims.anthropic.wire.chat_body``), and :func:`split_stop` takes it off and names it. Pure: nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error"}
"""Anthropic's error type for each status of its own that this server answers with; any other status is
``invalid_request_error`` below 500 and ``api_error`` from 500 on."""


def error_body(status: int, message: str) -> dict:
    """``{"type": "error", "error": {"type", "message"}}``: with the status, what the ``anthropic`` SDK turns into
    its typed exceptions (``BadRequestError``, ``NotFoundError``…)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def split_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """(the text before the stop string, the stop string), or (text, None) when none is in it. The first to start
    wins, the shorter of two starting together: the rule by which the text was cut just after it
    (``shims.openai.text.TextAssembler``), so a text holding a stop string ends with this one."""
    found = [(at, len(stop), stop) for stop in stops if (at := text.find(stop)) >= 0]
    if not found:
        return text, None
    at, _, stop = min(found)
    return text[:at], stop


def ending(finish_reason: str, called: bool, stop: str | None) -> dict:
    """Anthropic's ``stop_reason`` and ``stop_sequence``, as vLLM's Anthropic route decides them: a cut by
    ``max_tokens`` first; then ``tool_use`` whenever a tool was called (a forced one too, which OpenAI reports as
    ``stop``); then the stop sequence, which is named only then; else the model ended its turn."""
    if finish_reason == "length":
        reason = "max_tokens"
    elif called:
        reason = "tool_use"
    else:
        reason = "stop_sequence" if stop is not None else "end_turn"
    return {"stop_reason": reason, "stop_sequence": stop if reason == "stop_sequence" else None}


def message_id(completion_id: str) -> str:
    """``msg_…`` with the same hex as the completion's ``chatcmpl-…``, so the two are found together in logs."""
    return "msg_" + completion_id.removeprefix("chatcmpl-")


def tool_use(call: dict) -> dict:
    """An OpenAI tool call as a ``tool_use`` block: ``input`` is its parsed arguments (the model's text if they do
    not parse, so nothing it wrote is lost)."""
    arguments = call["function"]["arguments"]
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return {"type": "tool_use", "id": "toolu_" + call["id"].rsplit("-", 1)[-1], "name": call["function"]["name"],
            "input": value}


def message(completion: dict, stops: Sequence[str]) -> dict:
    """A ``chat.completion`` (one choice) as an Anthropic ``message``: its text, then a ``tool_use`` block per call.
    An empty reply is one empty text block, as Anthropic answers one."""
    choice = completion["choices"][0]
    text, stop = split_stop(choice["message"].get("content") or "", stops)
    calls = [tool_use(call) for call in choice["message"].get("tool_calls") or []]
    content = ([{"type": "text", "text": text}] if text or not calls else []) + calls
    return {"id": message_id(completion["id"]), "type": "message", "role": "assistant", "model": completion["model"],
            "content": content, **ending(choice["finish_reason"], bool(calls), stop),
            "usage": {"input_tokens": completion["usage"]["prompt_tokens"],
                      "output_tokens": completion["usage"]["completion_tokens"]}}


def event(payload: dict) -> bytes:
    """One server-sent event, named by its ``type`` as Anthropic's stream names them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class MessageStream:
    """A streamed chat completion (one choice, its usage chunk last) → Anthropic's events: ``message_start``;
    content blocks, each opened, filled by deltas and stopped (text as ``text_delta``, each tool call whole as one
    ``input_json_delta``); ``message_delta`` with the stop reason and the output tokens; ``message_stop``. The same
    :func:`split_stop` and :func:`tool_use` as :func:`message`, so a stream adds up to the whole answer.

    The text holds back no more than the chunks do: OpenAI's stream already holds back a tail that may become a
    stop string, so a delta never shows part of one before it is whole (and then it ends the text)."""

    def __init__(self, stops: Sequence[str], input_tokens: int) -> None:
        self.stops = list(stops)
        self.input_tokens = input_tokens
        self.started = False
        self.text, self.shown = "", 0
        self.block: str | None = None
        """The type of the open block, if one is open; its index is ``self.blocks - 1``."""
        self.blocks = 0
        self.called = False
        self.stop: str | None = None
        self.finish_reason = "stop"
        self.output_tokens = 0

    async def translate(self, chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        """``compat_server.completions.stream.stream``'s ``translate``: the events of each chunk, then the end of the
        message; an ``{"error": …}`` chunk becomes an ``error`` event, which ends the stream (the SDK raises it)."""
        async for chunk in chunks:
            if "error" in chunk:
                kind = "invalid_request_error" if chunk["error"]["type"] == "invalid_request_error" else "api_error"
                yield event({"type": "error", "error": {"type": kind, "message": chunk["error"]["message"]}})
                return
            for payload in self.events(chunk):
                yield event(payload)
        for payload in self.end():
            yield event(payload)

    def events(self, chunk: dict) -> list[dict]:
        out = []
        if not self.started:
            self.started = True
            out.append({"type": "message_start", "message": {
                "id": message_id(chunk["id"]), "type": "message", "role": "assistant", "model": chunk["model"],
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                out.extend(self._text(delta["content"]))
            for call in delta.get("tool_calls") or []:
                out.extend(self._tool_use(tool_use(call)))
            if choice["finish_reason"]:
                self.finish_reason = choice["finish_reason"]
        return out

    def end(self) -> list[dict]:
        """The open block's end (an empty text block if the reply had none), then the message's."""
        out = [] if self.blocks else self._open({"type": "text", "text": ""})
        out.extend(self._close())
        out.append({"type": "message_delta",
                    "delta": ending(self.finish_reason, self.called, self.stop),
                    "usage": {"output_tokens": self.output_tokens}})
        out.append({"type": "message_stop"})
        return out

    def _text(self, content: str) -> list[dict]:
        self.text += content
        visible, self.stop = split_stop(self.text, self.stops)
        new, self.shown = visible[self.shown:], max(self.shown, len(visible))
        if not new:
            return []
        out = [] if self.block == "text" else [*self._close(), *self._open({"type": "text", "text": ""})]
        out.append({"type": "content_block_delta", "index": self.blocks - 1,
                    "delta": {"type": "text_delta", "text": new}})
        return out

    def _tool_use(self, block: dict) -> list[dict]:
        self.called = True
        partial = json.dumps(block["input"], ensure_ascii=False)
        return [*self._close(), *self._open({**block, "input": {}}),
                {"type": "content_block_delta", "index": self.blocks - 1,
                 "delta": {"type": "input_json_delta", "partial_json": partial}},
                *self._close()]

    def _open(self, block: dict) -> list[dict]:
        self.block = block["type"]
        self.blocks += 1
        return [{"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]
