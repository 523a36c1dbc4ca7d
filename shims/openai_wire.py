"""OpenAI ``/v1/chat/completions`` and ``/v1/completions``: requests → sampling requests, and sampled tokens →
OpenAI response objects (whole, or as streamed chunks).

Requests are checked here with OpenAI's ranges and then become the same ``tinker`` ``SampleRequest`` the Tinker
route decodes, so both APIs share one set of sampling checks and one sampler path. Responses are built from the
``openai`` package's own types. Pure: the tokenizer is passed in, nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from pydantic import BaseModel, ConfigDict, ValidationError
from tinker import types
from transformers.convert_slow_tokenizer import bytes_to_unicode

from shims.sample_job import TokenEvent

MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
MAX_STOP_SEQUENCES = 4


class OpenAIError(Exception):
    """An error answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- requests -----------------------------------------------------------------------------------------------------
_M = TypeVar("_M", bound=BaseModel)
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingFields(_Strict):
    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """Not OpenAI's, but vLLM's extension, which OpenAI-compatible clients send through ``extra_body``."""
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


def parse_request(model: type[_M], body: Any) -> _M:
    """Validate a JSON body; the first problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        # pydantic names the union branch it tried (``str``, ``list[TextPart]``…) in the location: not a parameter
        param = ".".join(str(part) for part in error["loc"] if not _UNION_BRANCH.match(str(part)))
        if error["type"] == "extra_forbidden":
            raise OpenAIError(400, f"unsupported parameter: {param!r} is not supported by this server",
                              param=param, code="unsupported_parameter") from None
        if error["type"] == "missing":
            raise OpenAIError(400, f"missing required parameter: {param!r}", param=param,
                              code="missing_required_parameter") from None
        if param.startswith("messages.") and ".content" in param:
            raise OpenAIError(400, f"{param}: only text content is supported by this server (got "
                                   f"{error.get('input')!r:.80})", param=param) from None
        raise OpenAIError(400, f"invalid value for {param!r}: {error['msg']}", param=param,
                          code="invalid_value") from None


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as a chat template takes them: text parts joined into one string."""
    if not req.messages:
        raise OpenAIError(400, "messages must hold at least one message", param="messages")
    out = []
    for message in req.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out.append({**(message.model_extra or {}), "role": message.role, "content": content or "",
                    **({"name": message.name} if message.name else {})})
    return out


def completion_prompts(req: CompletionRequest, encode) -> list[list[int]]:
    """The prompt as token lists: a string, strings, token ids, or lists of token ids (one request each)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [encode(p) for p in prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    return prompts


def _in_range(value: float | None, low: float, high: float, param: str) -> None:
    if value is not None and not low <= value <= high:
        raise OpenAIError(400, f"{param} must be between {low} and {high}, got {value}", param=param,
                          code="invalid_value")


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0


def sample_request(req: ChatRequest | CompletionRequest, prompt: list[int]) -> tuple[types.SampleRequest, Penalties]:
    """The Tinker sample request for ``req`` (OpenAI's defaults and ranges applied), and the penalties, which the
    Tinker wire has no field for."""
    _in_range(req.temperature, 0, 2, "temperature")
    _in_range(req.top_p, 0, 1, "top_p")
    _in_range(req.presence_penalty, -2, 2, "presence_penalty")
    _in_range(req.frequency_penalty, -2, 2, "frequency_penalty")
    if req.n is not None and req.n < 1:
        raise OpenAIError(400, f"n must be at least 1, got {req.n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise OpenAIError(400, f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop")
    if isinstance(req, ChatRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None:
            _in_range(req.top_logprobs, 0, MAX_TOP_LOGPROBS_CHAT, "top_logprobs")
            if not req.logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else 0
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default for completions
        _in_range(req.logprobs, 0, MAX_LOGPROBS_COMPLETIONS, "logprobs")
        if req.echo:
            raise OpenAIError(400, "echo is not supported by this server", param="echo")
        k = req.logprobs or 0
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    params = types.SamplingParams(
        max_tokens=max_tokens, seed=req.seed, stop=stops or None,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k)
    sample = types.SampleRequest(num_samples=req.n or 1, prompt=types.ModelInput.from_ints(prompt),
                                 sampling_params=params, base_model="-", topk_sample_logprobs=k)
    return sample, Penalties(req.presence_penalty or 0.0, req.frequency_penalty or 0.0)


# ---- tokens → text ------------------------------------------------------------------------------------------------
class Vocabulary:
    """Token ids → text and bytes, over a Hugging Face tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict]) -> list[int]:
        """The model's chat template, ending with the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="model")
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template may refuse a message sequence (e.g. roles out of order)
            raise OpenAIError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_bytes(self, token: int) -> bytes:
        """The token's exact bytes (a byte-level BPE token may hold part of a UTF-8 character)."""
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        try:
            return bytes(self._byte_of[c] for c in piece)
        except (KeyError, TypeError):
            return self.tokenizer.decode([int(token)]).encode()

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")


class TextAssembler:
    """One sequence's text, built token by token: what may be shown so far, and the final text.

    Held back until more tokens arrive: an incomplete UTF-8 character, and any tail that could be the start of a stop
    string. The text ends before the first stop string (OpenAI never shows it). Streaming and whole responses both
    use this, so streamed deltas always concatenate to the whole response's text.
    """

    def __init__(self, vocab: Vocabulary, stop_strings: Sequence[str]) -> None:
        self.vocab, self.stops = vocab, list(stop_strings)
        self.tokens: list[int] = []
        self.shown = ""

    def _visible(self, final: bool) -> str:
        text = self.vocab.decode(self.tokens)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            return text[:min(cuts)]
        if final:
            return text
        text = text.rstrip("\ufffd")
        for hold in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-hold:]) for s in self.stops):
                return text[:-hold]
        return text

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """Add tokens; returns the text that became visible."""
        self.tokens.extend(tokens)
        visible = self._visible(final)
        if not visible.startswith(self.shown):  # a decoder that rewrote earlier text: show nothing new until final
            return ""
        delta, self.shown = visible[len(self.shown):], visible
        return delta


# ---- results → OpenAI objects -------------------------------------------------------------------------------------
@dataclass
class TokenLogprobs:
    """Per token: its logprob and, when asked, its top-k alternatives."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def add(self, event: TokenEvent) -> None:
        self.tokens.append(event.token)
        self.logprobs.append(event.logprob)
        if event.topk_ids is not None:
            self.topk.append((np.asarray(event.topk_ids).reshape(-1), np.asarray(event.topk_logprobs).reshape(-1)))


def _finite(value: float) -> float:
    return float(value) if np.isfinite(value) else -9999.0


def chat_logprobs(vocab: Vocabulary, lp: TokenLogprobs) -> dict:
    content = []
    for i, (token, logprob) in enumerate(zip(lp.tokens, lp.logprobs)):
        alternatives = []
        if i < len(lp.topk):
            ids, values = lp.topk[i]
            alternatives = [{"token": vocab.token_text(t), "logprob": _finite(v), "bytes": list(vocab.token_bytes(t))}
                            for t, v in zip(ids.tolist(), values.tolist())]
        content.append({"token": vocab.token_text(token), "logprob": _finite(logprob),
                        "bytes": list(vocab.token_bytes(token)), "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(vocab: Vocabulary, lp: TokenLogprobs, offset: int) -> CompletionLogprobs:
    texts = [vocab.token_text(t) for t in lp.tokens]
    offsets = list(np.cumsum([0, *[len(t) for t in texts[:-1]]]) + offset) if texts else []
    top = []
    for ids, values in lp.topk:
        top.append({vocab.token_text(t): _finite(v) for t, v in zip(ids.tolist(), values.tolist())})
    return CompletionLogprobs(tokens=texts, token_logprobs=[_finite(v) for v in lp.logprobs],
                              top_logprobs=top or None, text_offset=[int(o) for o in offsets])


FINISH = {"stop": "stop", "length": "length"}


@dataclass
class ChoiceOut:
    index: int
    text: str
    finish_reason: str
    logprobs: TokenLogprobs | None


def usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


def chat_completion(vocab: Vocabulary, id_: str, created: int, model: str, choices: list[ChoiceOut],
                    used: CompletionUsage) -> dict:
    return ChatCompletion.model_validate({
        "id": id_, "object": "chat.completion", "created": created, "model": model, "usage": used.model_dump(),
        "choices": [{"index": c.index, "finish_reason": FINISH[c.finish_reason],
                     "message": {"role": "assistant", "content": c.text, "refusal": None},
                     "logprobs": chat_logprobs(vocab, c.logprobs) if c.logprobs else None} for c in choices],
    }).model_dump(mode="json", exclude_unset=True)


def text_completion(vocab: Vocabulary, id_: str, created: int, model: str, choices: list[ChoiceOut],
                    used: CompletionUsage) -> dict:
    return Completion(
        id=id_, object="text_completion", created=created, model=model, usage=used,
        choices=[CompletionChoice(index=c.index, text=c.text, finish_reason=FINISH[c.finish_reason],
                                  logprobs=completion_logprobs(vocab, c.logprobs, 0) if c.logprobs else None)
                 for c in choices],
    ).model_dump(mode="json", exclude_unset=True)


def chat_chunk(vocab: Vocabulary, id_: str, created: int, model: str, *, index: int | None = None,
               role: bool = False, content: str | None = None, finish_reason: str | None = None,
               logprobs: TokenLogprobs | None = None, used: CompletionUsage | None = None) -> dict:
    """One ``chat.completion.chunk``: a delta for choice ``index``, or (``used``) the final usage chunk."""
    choices = []
    if index is not None:
        delta = {**({"role": "assistant"} if role else {}), **({"content": content} if content is not None else {})}
        choices.append({"index": index, "delta": delta, "finish_reason": FINISH.get(finish_reason),
                        "logprobs": chat_logprobs(vocab, logprobs) if logprobs else None})
    return ChatCompletionChunk.model_validate({
        "id": id_, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
        **({"usage": used.model_dump()} if used else {}),
    }).model_dump(mode="json", exclude_unset=True)


def completion_chunk(vocab: Vocabulary, id_: str, created: int, model: str, *, index: int | None = None,
                     text: str = "", finish_reason: str | None = None, logprobs: TokenLogprobs | None = None,
                     offset: int = 0, used: CompletionUsage | None = None) -> dict:
    """One streamed ``text_completion`` object: a text delta for choice ``index``, or the final usage chunk. Plain
    dicts: OpenAI streams ``finish_reason: null`` mid-stream, which its ``Completion`` type does not admit."""
    choices = []
    if index is not None:
        choices.append({"index": index, "text": text, "finish_reason": FINISH.get(finish_reason),
                        "logprobs": completion_logprobs(vocab, logprobs, offset).model_dump(mode="json")
                        if logprobs else None})
    return {"id": id_, "object": "text_completion", "created": created, "model": model, "choices": choices,
            **({"usage": used.model_dump(mode="json")} if used else {})}
