"""vLLM's tokenizer routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``): request bodies and answers. Tools
such as lm-evaluation-harness probe them to tokenize through the server instead of loading the tokenizer
themselves. Pure: the tokenizer is passed in."""

from __future__ import annotations

from typing import Any

from shims.lenient import Lenient
from shims.openai.errors import OpenAIError
from shims.openai.text import Vocabulary
from shims.openai.wire import ChatMessage, Tool, chat_messages


class TokenizeRequest(Lenient):
    """Either a text ``prompt`` or chat ``messages`` (rendered with the chat template, as a chat request would be)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


def tokenize(vocab: Vocabulary, req: TokenizeRequest, max_model_len: int) -> dict:
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "give either prompt (text) or messages (chat)", param="prompt")
    if req.prompt is not None:  # vLLM: a text prompt gets the tokenizer's special tokens unless told otherwise
        tokens = vocab.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []]
        tokens = vocab.render_chat(chat_messages(req.messages), tools=tools,
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   template_kwargs=req.chat_template_kwargs)
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": vocab.token_strings(tokens) if req.return_token_strs else None}


def detokenize(vocab: Vocabulary, req: DetokenizeRequest, vocab_size: int) -> dict:
    if bad := [t for t in req.tokens if not 0 <= t < vocab_size]:
        raise OpenAIError(400, f"tokens has token id {bad[0]} outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": vocab.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(vocab: Vocabulary, max_model_len: int) -> dict:
    """What lm-evaluation-harness (``tokenizer_backend="remote"``) reads: the special tokens, and the template."""
    tok = vocab.tokenizer
    return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id, "pad_token": tok.pad_token,
            "pad_token_id": tok.pad_token_id, "model_max_length": max_model_len,
            "chat_template": getattr(tok, "chat_template", None)}
