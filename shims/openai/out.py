"""Sampled tokens → OpenAI response objects: chat completions and text completions, whole or as streamed chunks,
with logprobs in each API's shape and vLLM's ``prompt_logprobs`` extension. Pure: nothing here does I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from shims.openai.text import Vocabulary
from shims.sampling.job import PromptScores, SequenceResult, TokenEvent

LOGPROB_FLOOR = -9999.0
"""What OpenAI (and vLLM) write for a logprob of -inf, which JSON cannot hold."""


@dataclass
class TokenLogprobs:
    """Per token: its logprob and its top-k alternatives (either None for a prompt's first token, which nothing
    predicts)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    topk: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)

    def add(self, event: TokenEvent) -> None:
        self.tokens.append(event.token)
        self.logprobs.append(event.logprob)
        self.topk.append(None if event.topk_ids is None else
                         (np.asarray(event.topk_ids).reshape(-1), np.asarray(event.topk_logprobs).reshape(-1)))

    @classmethod
    def of_sequence(cls, seq: SequenceResult, start: int = 0) -> TokenLogprobs:
        """A finished sequence's logprobs from token ``start`` on."""
        topk = [None] * (len(seq.tokens) - start)
        if seq.topk_ids is not None:
            topk = list(zip(seq.topk_ids[start:], seq.topk_logprobs[start:]))
        return cls(list(seq.tokens[start:]), list(seq.logprobs[start:]), topk)

    @classmethod
    def of_prompt(cls, prompt: Sequence[int], scores: PromptScores) -> TokenLogprobs:
        """The prompt's own logprobs (``echo``): its first token has none."""
        logprobs = [None] + [float(v) for v in scores.logprobs[1:]]
        topk = [None] * len(prompt)
        if scores.topk_ids is not None:
            topk = [None] + list(zip(scores.topk_ids[1:], scores.topk_logprobs[1:]))
        return cls(list(prompt), logprobs, topk)

    def __add__(self, other: TokenLogprobs) -> TokenLogprobs:
        return TokenLogprobs(self.tokens + other.tokens, self.logprobs + other.logprobs, self.topk + other.topk)


def _finite(value: float | None) -> float | None:
    return None if value is None else float(value) if np.isfinite(value) else LOGPROB_FLOOR


def _alternatives(lp: TokenLogprobs, i: int) -> list[tuple[int, float]]:
    if lp.topk[i] is None:
        return []
    ids, values = lp.topk[i]
    return [(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist())]


def chat_logprobs(vocab: Vocabulary, lp: TokenLogprobs) -> dict:
    content = []
    for i, (token, logprob) in enumerate(zip(lp.tokens, lp.logprobs)):
        content.append({"token": vocab.token_text(token), "logprob": _finite(logprob),
                        "bytes": list(vocab.token_bytes(token)),
                        "top_logprobs": [{"token": vocab.token_text(t), "logprob": _finite(v),
                                          "bytes": list(vocab.token_bytes(t))} for t, v in _alternatives(lp, i)]})
    return {"content": content, "refusal": None}


def completion_logprobs(vocab: Vocabulary, lp: TokenLogprobs, offset: int) -> dict:
    """Parallel lists, as vLLM writes them: each position's ``top_logprobs`` holds the token itself and its top-k
    (so k + 1 entries at most); a prompt's first position has null logprob and null top_logprobs."""
    texts = [vocab.token_text(t) for t in lp.tokens]
    offsets = [int(o) for o in np.cumsum([0, *[len(t) for t in texts[:-1]]]) + offset] if texts else []
    top = []
    for i, (token, logprob) in enumerate(zip(lp.tokens, lp.logprobs)):
        if logprob is None:
            top.append(None)
            continue
        entries = {vocab.token_text(token): _finite(logprob)}
        for t, v in _alternatives(lp, i):
            entries.setdefault(vocab.token_text(t), _finite(v))
        top.append(entries)
    return {"tokens": texts, "token_logprobs": [_finite(v) for v in lp.logprobs], "top_logprobs": top,
            "text_offset": offsets}


def prompt_logprobs(vocab: Vocabulary, prompt: Sequence[int], scores: PromptScores) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt position, None for the first, then ``{token id: {logprob, rank,
    decoded_token}}`` for the prompt's token and the top-k. A rank is 1 for the most likely token; the prompt
    token's own rank is given where the backend reports it (``PromptScores.ranks``)."""
    out: list[dict | None] = [None]
    for i in range(1, len(prompt)):
        entries = {}
        alternatives = []
        if scores.topk_ids is not None:
            alternatives = list(zip(scores.topk_ids[i].tolist(), scores.topk_logprobs[i].tolist()))
        rank_of = {int(t): r + 1 for r, (t, _) in enumerate(alternatives)}
        token = int(prompt[i])
        own_rank = int(scores.ranks[i]) if scores.ranks is not None else rank_of.get(token)
        entries[str(token)] = {"logprob": _finite(float(scores.logprobs[i])), "rank": own_rank,
                               "decoded_token": vocab.token_text(token)}
        for t, v in alternatives:
            entries.setdefault(str(int(t)), {"logprob": _finite(v), "rank": rank_of[int(t)],
                                             "decoded_token": vocab.token_text(int(t))})
        out.append(entries)
    return out


FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


@dataclass
class ChoiceOut:
    index: int
    text: str | None
    finish_reason: str
    logprobs: TokenLogprobs | None
    tool_calls: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None
    """Completions only: vLLM puts a completion's prompt logprobs on each choice (a chat's go on the response)."""


def usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


def chat_completion(vocab: Vocabulary, id_: str, created: int, model: str, choices: list[ChoiceOut],
                    used: CompletionUsage, prompt_lps: list[dict | None] | None = None) -> dict:
    body = ChatCompletion.model_validate({
        "id": id_, "object": "chat.completion", "created": created, "model": model, "usage": used.model_dump(),
        "choices": [{"index": c.index, "finish_reason": FINISH[c.finish_reason],
                     "message": {"role": "assistant", "content": c.text, "refusal": None,
                                 **({"tool_calls": c.tool_calls} if c.tool_calls else {})},
                     "logprobs": chat_logprobs(vocab, c.logprobs) if c.logprobs else None} for c in choices],
    }).model_dump(mode="json", exclude_unset=True)
    if prompt_lps is not None:
        body["prompt_logprobs"] = prompt_lps
    return body


def text_completion(vocab: Vocabulary, id_: str, created: int, model: str, choices: list[ChoiceOut],
                    used: CompletionUsage) -> dict:
    """Plain dicts: an echoed prompt's first logprob is null, which the ``openai`` package's types do not admit."""
    return {"id": id_, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": FINISH[c.finish_reason],
                         "logprobs": completion_logprobs(vocab, c.logprobs, 0) if c.logprobs else None,
                         **({"prompt_logprobs": c.prompt_logprobs} if c.prompt_logprobs is not None else {})}
                        for c in choices],
            "usage": used.model_dump(mode="json")}


def chat_chunk(vocab: Vocabulary, id_: str, created: int, model: str, *, index: int | None = None,
               role: bool = False, content: str | None = None, finish_reason: str | None = None,
               logprobs: TokenLogprobs | None = None, used: CompletionUsage | None = None,
               tool_calls: list[dict] | None = None) -> dict:
    """One ``chat.completion.chunk``: a delta for choice ``index``, or (``used``) the final usage chunk. Tool calls
    are numbered within their choice (``index``), each whole in one delta."""
    choices = []
    if index is not None:
        delta = {**({"role": "assistant"} if role else {}), **({"content": content} if content is not None else {})}
        if tool_calls:
            delta["tool_calls"] = [{"index": n, **call} for n, call in tool_calls]
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
                        "logprobs": completion_logprobs(vocab, logprobs, offset) if logprobs else None})
    return {"id": id_, "object": "text_completion", "created": created, "model": model, "choices": choices,
            **({"usage": used.model_dump(mode="json")} if used else {})}
