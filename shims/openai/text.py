"""Text ↔ tokens for the OpenAI-style routes: prompts and chat templates in, token ids out to text, whole or streamed.

Pure: the Hugging Face tokenizer is passed in; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from shims.openai.errors import OpenAIError

RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize", "return_dict",
                                    "add_generation_prompt", "continue_final_message", "chat_template", "padding",
                                    "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask"})
"""``apply_chat_template`` arguments the server sets itself; ``chat_template_kwargs`` may not override them."""


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can stand for: the longest entry of its vocabulary, added and
    special tokens included (a byte-level token's entry has one character per byte, so it is never shorter than the
    text it decodes to). vLLM bounds prompts with the same figure (``max_chars_per_token``)."""
    return max(len(token) for token in tokenizer.get_vocab())


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt text the server tokenizes, checked before tokenizing: a text longer than ``max_chars``
    would cost tokenizer time and memory in proportion to its size only to be refused. By default ``max_chars`` is
    the model's context × its longest token's characters, which only a text of more tokens than the context can
    exceed; ``option`` names the server option that set it instead, if one did."""

    max_chars: int
    max_context: int
    option: str | None = None

    def check(self, chars: int, param: str) -> None:
        """Refuse a prompt of ``chars`` characters over the limit, in the words vLLM's server uses for it."""
        if chars <= self.max_chars:
            return
        bound = (f"more than the {self.max_chars} characters this server tokenizes ({self.option})" if self.option
                 else f"more than {self.max_chars} characters, which is the upper bound for {self.max_context} "
                      "input tokens")
        raise OpenAIError(400, f"This model's maximum context length is {self.max_context} tokens. However, your "
                               f"prompt contains {chars} characters ({bound}). Please reduce the length of the "
                               f"{param}.", param=param)


class Vocabulary:
    """Token ids → text and bytes, over a Hugging Face tokenizer. With a ``limit``, a prompt text (or a rendered
    chat) longer than it is refused before it is tokenized."""

    def __init__(self, tokenizer, limit: PromptLimit | None = None) -> None:
        self.tokenizer = tokenizer
        self.limit = limit
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._rust = _rust_decoder(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.limit is not None:
            self.limit.check(len(text), "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The model's chat template over ``messages`` (and ``tools``, which the template writes into the prompt in
        the format the model was trained to call them in), by default ending with the assistant's turn opened;
        ``continue_final_message`` leaves the last (assistant) message open for the model to continue instead."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="model")
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                              param="continue_final_message")
        extra = dict(template_kwargs or {})
        if clash := sorted(RESERVED_TEMPLATE_ARGS & set(extra)):
            raise OpenAIError(400, f"chat_template_kwargs may not set {', '.join(clash)}: the server sets them",
                              param="chat_template_kwargs")
        try:  # rendered as text first (what ``tokenize=True`` does too), so its length is checked before tokenizing
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **extra)
        except Exception as exc:  # noqa: BLE001 - a template may refuse a message sequence (e.g. roles out of order)
            raise OpenAIError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
        if self.limit is not None:
            self.limit.check(len(text), "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._rust is not None:  # the same text; ``decode_batch`` lets go of the GIL while it decodes
            return self._rust.decode_batch([list(tokens)], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def token_bytes(self, token: int) -> bytes:
        """The token's exact bytes (a byte-level BPE token may hold part of a UTF-8 character)."""
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        try:
            return bytes(self._byte_of[c] for c in piece)
        except (KeyError, TypeError):
            return self.tokenizer.decode([int(token)]).encode()

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def token_strings(self, tokens: Sequence[int]) -> list[str]:
        """The tokenizer's own spelling of each token (``Ġthe``), as vLLM's ``/tokenize`` gives ``token_strs``."""
        return list(self.tokenizer.convert_ids_to_tokens([int(t) for t in tokens]))


def _rust_decoder(tokenizer):
    """The Rust tokenizer under a Hugging Face fast tokenizer whose class decodes through it unchanged (one that
    overrides decoding, as CodeGen's does, keeps its own), or None. Its ``decode`` holds the GIL for the whole call,
    which would stall the event loop even from a worker thread; ``decode_batch`` does not."""
    cls = type(tokenizer)
    if isinstance(tokenizer, TokenizersBackend) and cls.decode is TokenizersBackend.decode \
            and cls._decode is TokenizersBackend._decode:
        return tokenizer.backend_tokenizer
    return None


class TextAssembler:
    """One sequence's text, built token by token: what may be shown so far, and the final text.

    Held back until more tokens arrive: an incomplete UTF-8 character, and any tail that could be the start of a stop
    string. The text ends before the first stop string (OpenAI never shows it), or just after it with
    ``include_stop`` (vLLM's ``include_stop_str_in_output``). Streaming and whole responses both use this, so
    streamed deltas always concatenate to the whole response's text.
    """

    def __init__(self, vocab: Vocabulary, stop_strings: Sequence[str], *, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.vocab, self.stops = vocab, list(stop_strings)
        self.include_stop, self.skip_special = include_stop, skip_special_tokens
        self.tokens: list[int] = []
        self.shown = ""

    def _visible(self, final: bool) -> str:
        text = self.vocab.decode(self.tokens, self.skip_special)
        cuts = [(i, len(s)) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        if cuts:
            at, length = min(cuts)
            return text[:at + length] if self.include_stop else text[:at]
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
