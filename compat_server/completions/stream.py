"""Streamed chat and text completions: server-sent events built as tokens arrive from the sampler.

The same :class:`ChoiceOutput` as the whole response decides what each delta shows (stop strings, partial characters,
tool calls), so a stream's deltas always add up to the whole response. Each step's text is decoded in the
completions service's workers, not on the event loop: every push decodes its choice's tokens so far.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from compat_server.completions.service import CompletionsService, Prepared
from shims.errors import UserError
from shims.openai.errors import OpenAIError
from shims.openai.out import TokenLogprobs, chat_chunk, completion_chunk, usage
from shims.sampling.job import SampleJob, SampleResult, TokenEvent

log = logging.getLogger("compat_server.openai")


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


Translate = Callable[[AsyncIterator[dict]], AsyncIterator[bytes]]
"""Turns the stream's OpenAI chunks (``chat.completion.chunk`` / ``text_completion`` dicts, or an ``{"error": …}``
body) into another API's events: the Responses and Anthropic routes stream through the same path this way."""


def stream(service: CompletionsService, p: Prepared, translate: Translate | None = None) -> AsyncIterator[bytes]:
    """Server-sent events: (chat) each choice's role first; text deltas as tokens arrive; each choice's last delta
    with its finish_reason; the usage chunk if asked for; ``[DONE]`` (after the key's count is given back).
    Prompts of a multi-prompt completion are streamed one after the other. ``translate`` re-shapes the chunks for
    another API (which then ends its stream in its own way).

    A key at its request limit is refused here, before the 200 status line goes out; the stream itself counts
    against the limit from its first event until it ends (counting inside the generator is what guarantees the
    count is given back, even when the client goes away before the stream starts)."""
    service.quota.check(p.owner)
    return _stream(service, p, translate)


async def _openai_events(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield sse(chunk)


async def _stream(service: CompletionsService, p: Prepared, translate: Translate | None) -> AsyncIterator[bytes]:
    with service.quota.hold(p.owner, checked=False):  # admitted by ``stream``
        async for event in (translate or _openai_events)(_events(service, p)):
            yield event
    if translate is None:  # sent once the count is given back: a client that has seen the end may go on at once
        yield sse("[DONE]")


class _ChoiceStream:
    """One choice's state in a stream: what it has shown, its text offset, the tool calls it has sent."""

    def __init__(self, p: Prepared, index: int) -> None:
        self.p, self.index = p, index
        self.output = p.output()
        self.offset = 0
        self.calls_sent = 0
        self.echoed = not p.echo

    def echo(self, job: SampleJob, result: SampleResult | None) -> dict | None:
        """The echoed prompt, once, before the choice's own text (its logprobs only once the result has them)."""
        if self.echoed:
            return None
        self.echoed = True
        if result is not None:
            text, lps = self.p.echoed(job, result)
        else:
            text, lps = self.p.vocab.decode(job.prompt, self.p.skip_special_tokens), None
        return self.chunk(text, [], lps)

    def chunk(self, text: str, calls: list[dict], logprobs: TokenLogprobs | None = None,
              finish_reason: str | None = None) -> dict | None:
        p = self.p
        if not (text or calls or logprobs or finish_reason):
            return None
        header = (p.vocab, p.id, p.created, p.model)
        if p.chat:
            numbered = list(enumerate(calls, start=self.calls_sent))
            self.calls_sent += len(calls)
            body = chat_chunk(*header, index=self.index, content=text or None, finish_reason=finish_reason,
                              logprobs=logprobs, tool_calls=numbered)
        else:
            body = completion_chunk(*header, index=self.index, text=text, finish_reason=finish_reason,
                                    logprobs=logprobs, offset=self.offset)
        self.offset += len(text)
        return body


async def _events(service: CompletionsService, p: Prepared) -> AsyncIterator[dict]:
    header = (p.vocab, p.id, p.created, p.model)
    chunk = chat_chunk if p.chat else completion_chunk
    completion_tokens = 0
    try:
        for i, job in enumerate(p.jobs):
            choices = [_ChoiceStream(p, p.choice_index(i, j)) for j in range(job.num_samples)]
            if p.chat:
                for choice in choices:
                    yield chat_chunk(*header, index=choice.index, role=True, content="")
            # The prompt's logprobs come with the result: echo with logprobs (and echo alone) is answered whole.
            whole_only = p.echo and p.logprobs or not p.sampled_shown
            async for item in service.sampling.stream_job(p.target, job):
                if isinstance(item, SampleResult):
                    events, tokens = await service.workers.run(_last_chunks, p, job, choices, item)
                    completion_tokens += tokens
                elif whole_only:
                    continue
                else:
                    events = await service.workers.run(_step_chunks, p, job, choices, item)
                for event in events:
                    yield event
        if p.include_usage:
            yield chunk(*header, used=usage(p.prompt_tokens, completion_tokens))
    except (OpenAIError, UserError) as exc:
        error = exc if isinstance(exc, OpenAIError) else OpenAIError(400, str(exc))
        yield error.body()
    except Exception as exc:  # the status line is already sent: the error travels as an event
        log.exception("streaming %s failed", p.id)
        yield OpenAIError(500, f"internal server error: {exc}", kind="server_error").body()


def _last_chunks(p: Prepared, job: SampleJob, choices: list[_ChoiceStream],
                 result: SampleResult) -> tuple[list[dict], int]:
    """Each choice's last chunks once its job's result is in (the echo, if not yet sent; the rest of its text, with
    its finish_reason), and the completion tokens they hold."""
    events, completion_tokens = [], 0
    for choice, seq in zip(choices, result.sequences):
        if event := choice.echo(job, result):
            events.append(event)
        shown = len(choice.output.tokens)
        new = seq.tokens[shown:] if p.sampled_shown else []
        content, calls = choice.output.push(new, final=True)
        lps = TokenLogprobs.of_sequence(seq, shown) if p.logprobs and new else None
        reason = choice.output.finish_reason(seq.stop_reason if p.sampled_shown else "length")
        events.append(choice.chunk(content, calls, lps, reason))
        completion_tokens += len(seq.tokens) if p.sampled_shown else 0
    return events, completion_tokens


def _step_chunks(p: Prepared, job: SampleJob, choices: list[_ChoiceStream], step: list[TokenEvent]) -> list[dict]:
    """The chunks one sampler step's tokens make visible, choice by choice."""
    events = []
    for j, step_events in _by_sequence(step).items():
        choice = choices[j]
        if event := choice.echo(job, None):
            events.append(event)
        content, calls = choice.output.push([e.token for e in step_events])
        lps = None
        if p.logprobs:
            lps = TokenLogprobs()
            for e in step_events:
                lps.add(e)
        if event := choice.chunk(content, calls, lps):
            events.append(event)
    return events


def _by_sequence(events: list[TokenEvent]) -> dict[int, list[TokenEvent]]:
    grouped: dict[int, list[TokenEvent]] = {}
    for event in events:
        grouped.setdefault(event.index, []).append(event)
    return grouped
