"""Chat completions → OpenAI Responses API objects: a ``chat.completion`` → a ``response``, and a stream of
``chat.completion.chunk`` dicts → the Responses API's server-sent events.

The assistant's text is one ``message`` output item and each tool call a ``function_call`` item after it. A response
cut short by its token limit is ``incomplete`` (reason ``max_output_tokens``); its stream ends with
``response.incomplete`` rather than ``response.completed``, as OpenAI's does. Every response object is built through
the ``openai`` package's own ``Response`` type, so its shape is the SDK's. Pure: no I/O.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from openai.types.responses import Response


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_id(chat_id: str) -> str:
    """The response's id from its chat completion's (``chatcmpl-<hex>`` → ``resp_<hex>``): one request, one id."""
    return "resp_" + chat_id.split("-", 1)[-1]


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    """A chat tool call as a ``function_call`` item: its chat id is the ``call_id`` the next turn answers to."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


def response_usage(used: dict) -> dict:
    return {"input_tokens": used["prompt_tokens"], "output_tokens": used["completion_tokens"],
            "total_tokens": used["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def response_object(settings: dict, *, id_: str, created: int, model: str, status: str, output: list[dict],
                    usage: dict | None = None) -> dict:
    """A ``response`` object: the request's echoed ``settings`` and what was sampled, checked by the SDK's type."""
    return Response.model_validate({
        **settings, "id": id_, "object": "response", "created_at": created, "model": model, "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None, "error": None,
        "output": output, "usage": response_usage(usage) if usage else None,
    }).model_dump(mode="json", by_alias=True, exclude_unset=True)


def from_chat_completion(completion: dict, settings: dict) -> dict:
    """A whole ``chat.completion`` as a response. Its message item is there unless the model only called tools (an
    empty reply is an empty message, as in a stream)."""
    choice = completion["choices"][0]
    text, calls = choice["message"].get("content"), choice["message"].get("tool_calls") or []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output = []
    if text or not calls:  # text before calls ended when they began, as its stream closes it
        output.append(message_item(_new_id("msg"), text or "", "completed" if calls else status))
    output += [function_call_item(_new_id("fc"), call) for call in calls]
    return response_object(settings, id_=response_id(completion["id"]), created=completion["created"],
                           model=completion["model"], status=status, output=output, usage=completion.get("usage"))


def sse_event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


class ResponseEvents:
    """One streamed response: chat chunks in, Responses events out. ``response.created`` and
    ``response.in_progress`` on the first chunk; the message item opens on the first text (its part added, then a
    delta per chunk) and closes before a tool call's item or at the end; each call is an item whose arguments come in
    one delta (the chat stream sends each call whole); the final event carries the whole response with the same items.
    An ``{"error": …}`` body becomes an ``error`` event, the stream's last."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.sequence = 0
        self.header: dict | None = None
        self.output: list[dict] = []
        self.message: dict | None = None
        """The open message item: its id and text so far."""
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    async def translate(self, chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        """The ``translate`` that ``compat_server.completions.stream.stream`` takes."""
        async for chunk in chunks:
            for event in self.push(chunk):
                yield sse_event(event)
            if "error" in chunk:
                return
        for event in self.finish():
            yield sse_event(event)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def _response(self, status: str) -> dict:
        h = self.header
        return response_object(self.settings, id_=response_id(h["id"]), created=h["created"], model=h["model"],
                               status=status, output=self.output if status != "in_progress" else [],
                               usage=self.usage if status != "in_progress" else None)

    def push(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            error = chunk["error"]
            return [self._event("error", code=error.get("code"), message=error["message"], param=error.get("param"))]
        events = []
        if self.header is None:
            self.header = {"id": chunk["id"], "created": chunk["created"], "model": chunk["model"]}
            events.append(self._event("response.created", response=self._response("in_progress")))
            events.append(self._event("response.in_progress", response=self._response("in_progress")))
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk["choices"]:  # one choice: a Responses request has no ``n``
            delta = choice["delta"]
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._close_message("completed") + self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def finish(self) -> list[dict]:
        """The events after the last chunk: the message closed (an empty one if nothing was written), the end."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events = self._text("") if not self.output and self.message is None else []
        events += self._close_message(status)
        return events + [self._event(f"response.{status}", response=self._response(status))]

    def _text(self, delta: str) -> list[dict]:
        events = []
        if self.message is None:
            self.message = {"id": _new_id("msg"), "text": ""}
            events.append(self._event("response.output_item.added", output_index=len(self.output),
                                      item={**message_item(self.message["id"], "", "in_progress"), "content": []}))
            events.append(self._part("response.content_part.added", ""))
        self.message["text"] += delta
        if delta:
            events.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                      output_index=len(self.output), content_index=0, delta=delta, logprobs=[]))
        return events

    def _part(self, kind: str, text: str) -> dict:
        return self._event(kind, item_id=self.message["id"], output_index=len(self.output), content_index=0,
                           part={"type": "output_text", "text": text, "annotations": []})

    def _close_message(self, status: str) -> list[dict]:
        if self.message is None:
            return []
        item_id, text = self.message["id"], self.message["text"]
        item = message_item(item_id, text, status)
        events = [self._event("response.output_text.done", item_id=item_id, output_index=len(self.output),
                              content_index=0, text=text, logprobs=[]),
                  self._part("response.content_part.done", text),
                  self._event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.message = None
        return events

    def _call(self, call: dict) -> list[dict]:
        item_id, index = _new_id("fc"), len(self.output)
        item = function_call_item(item_id, call)
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=index,
                            item=function_call_item(item_id, call, "in_progress")),
                self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=item["arguments"]),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]
