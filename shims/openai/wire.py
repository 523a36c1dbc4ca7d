"""OpenAI ``/v1/chat/completions`` and ``/v1/completions`` request bodies: the fields OpenAI defines and the sampling
extensions vLLM's server adds, parsed into typed requests.

As in vLLM's server, a field this server does not know is accepted and ignored (``ignored_fields`` lists them, and
the response says so in ``X-Ignored-Fields``), so clients that send newer OpenAI fields (``store``, ``metadata``,
``service_tier``…) keep working. A field that would change the result and that this server cannot honour is
refused instead (``REFUSED``), never silently dropped. Pure: nothing here does I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shims.lenient import Lenient
from shims.openai.errors import OpenAIError

_M = TypeVar("_M", bound="Lenient")
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*|literal\[.*\]|function-.*)$")


class StreamOptions(Lenient):
    include_usage: bool | None = None


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: ToolName


class JsonSchemaFormat(Lenient):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Lenient):
    """vLLM's ``structured_outputs`` extension; of its kinds, ``json`` and ``json_object``."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class _SamplingFields(Lenient):
    model: str | None = None
    """Optional when the server has one base model (vLLM's rule: it is then the default)."""
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older spelling of ``structured_outputs.json``."""
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    """vLLM's: whether the tokenizer adds its special tokens (e.g. a BOS) to a text prompt."""


REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0), "allowed_token_ids": (None,), "bad_words": (None, []), "suffix": (None, ""),
    "truncate_prompt_tokens": (None,), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "guided_regex": (None,), "guided_grammar": (None,), "guided_choice": (None,),
    "chat_template": (None,), "documents": (None,), "echo": (None, False), "prompt_embeds": (None,),
}
"""Fields (OpenAI's or vLLM's) that change the result and that this server does not implement, with the values that
leave the result unchanged (those are accepted). Chat ``echo`` is vLLM's (prepend the last message); completions'
``echo`` is a known field there and never reaches this table."""


def ignored_fields(req: _SamplingFields) -> list[str]:
    """The request's fields this server does not know: accepted, and ignored, as vLLM does."""
    return sorted(req.model_extra or {})


def parse_request(model: type[_M], body: Any) -> _M:
    """Validate a JSON body; the first problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for name, harmless in REFUSED.items():
        if name in body and name not in model.model_fields and body[name] not in harmless:
            raise OpenAIError(400, f"unsupported parameter: {name!r} is not supported by this server (vLLM's "
                                   "server supports it; this one does not yet)", param=name,
                              code="unsupported_parameter")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        # pydantic names the union branch it tried (``str``, ``list[TextPart]``…) in the location: not a parameter
        param = ".".join(str(part) for part in error["loc"] if not _UNION_BRANCH.match(str(part)))
        if error["type"] == "missing":
            raise OpenAIError(400, f"missing required parameter: {param!r}", param=param,
                              code="missing_required_parameter") from None
        if param.startswith("messages.") and ".content" in param:
            raise OpenAIError(400, f"{param}: only text content is supported by this server (got "
                                   f"{error.get('input')!r:.80})", param=param) from None
        raise OpenAIError(400, f"invalid value for {param!r}: {error['msg']}", param=param,
                          code="invalid_value") from None


def _text(content: str | list[TextPart] | None) -> str:
    """A message's text; text parts joined by newlines, as vLLM joins them for templates that take a string."""
    if isinstance(content, list):
        return "\n".join(part.text for part in content)
    return content or ""


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as a chat template takes them: text parts joined into one string (by newlines), tool calls' JSON arguments as
    objects (templates write them with ``tojson``), other fields passed through for templates that read them."""
    if not messages:
        raise OpenAIError(400, "messages must hold at least one message", param="messages")
    out = []
    for message in messages:
        entry = {**(message.model_extra or {}), "role": message.role, "content": _text(message.content)}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": _arguments(call.function.arguments)}}
                                   for call in message.tool_calls]
        out.append(entry)
    return out


def _arguments(arguments: str | dict) -> dict | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def completion_inputs(req: CompletionRequest) -> list[str | list[int]]:
    """The prompt as one input per prompt: a text still to tokenize, or token ids (a string, strings, token ids, or
    lists of token ids). The server tokenizes the texts one by one off its event loop."""
    prompt = req.prompt
    if isinstance(prompt, str):
        inputs = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        inputs = list(prompt)
    elif prompt and all(isinstance(p, int) for p in prompt):
        inputs = [list(prompt)]
    else:
        inputs = [list(p) for p in prompt]
    _check_not_empty(inputs)
    return inputs


def completion_prompts(req: CompletionRequest, encode) -> list[list[int]]:
    """The prompt as token lists, its texts tokenized by ``encode`` (one request each)."""
    prompts = [encode(p) if isinstance(p, str) else p for p in completion_inputs(req)]
    _check_not_empty(prompts)
    return prompts


def _check_not_empty(prompts: list) -> None:
    if not prompts or any(not p for p in prompts):
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
