"""The OpenAI-compatible operations: list models, chat completions and text completions, whole or streamed.

They sample through ``SamplingService`` exactly as the Tinker ``asample`` route does (same checks, same pool, same
metrics); this module only adds tokenizers, OpenAI's parameter rules and response objects (``shims.openai_wire``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import datetime

from adapters.base_models import BaseModelSpec
from compat_server.quotas import KeyQuota
from compat_server.records import Records
from compat_server.sampling import ModelNotFound, SamplingService, Target
from shims.errors import UserError
from shims.openai_wire import (
    ChatRequest,
    ChoiceOut,
    CompletionRequest,
    OpenAIError,
    TextAssembler,
    TokenLogprobs,
    Vocabulary,
    chat_chunk,
    chat_completion,
    chat_messages,
    completion_chunk,
    completion_prompts,
    parse_request,
    sample_request,
    text_completion,
    usage,
)
from shims.sample_job import SampleJob, SampleResult, TokenEvent
from shims.sampling_wire import decode_sample_request

log = logging.getLogger("compat_server.openai")


@dataclass
class Prepared:
    """A checked request, ready to sample: one job per prompt (chat has one)."""

    chat: bool
    owner: str
    model: str
    target: Target
    vocab: Vocabulary
    jobs: list[SampleJob]
    logprobs: bool
    stream: bool
    include_usage: bool
    id: str
    created: int

    @property
    def stops(self) -> tuple[str, ...]:
        return self.jobs[0].stop_strings

    @property
    def prompt_tokens(self) -> int:
        return sum(len(job.prompt) for job in self.jobs)

    def choice_index(self, prompt: int, sample: int) -> int:
        return prompt * self.jobs[0].num_samples + sample


def _unix(stamp: str) -> int:
    return int(datetime.fromisoformat(stamp).timestamp())


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _logprobs(seq, start: int = 0) -> TokenLogprobs:
    """A finished sequence's logprobs from token ``start`` on."""
    lp = TokenLogprobs(tokens=list(seq.tokens[start:]), logprobs=list(seq.logprobs[start:]))
    if seq.topk_ids is not None:
        lp.topk = list(zip(seq.topk_ids[start:], seq.topk_logprobs[start:]))
    return lp


class CompletionsService:
    def __init__(self, sampling: SamplingService, records: Records, base_models: dict[str, BaseModelSpec],
                 quota: KeyQuota) -> None:
        self.sampling = sampling
        self.quota = quota
        self.records = records
        self.base_models = base_models
        self.started = int(time.time())
        self._vocabs: dict[str, Vocabulary] = {}

    def vocabulary(self, base_model: str) -> Vocabulary:
        if base_model not in self._vocabs:
            from transformers import AutoTokenizer

            spec = self.base_models[base_model]
            # From where the server loads the model: ``tokenizer_id`` is the name given to clients, which for the
            # built-in model would send the hub library looking for it online first.
            self._vocabs[base_model] = Vocabulary(AutoTokenizer.from_pretrained(spec.location))
        return self._vocabs[base_model]

    # ---- models ---------------------------------------------------------------------------------------------------
    def list_models(self, owner: str) -> dict:
        """Base models, then every sampler checkpoint the caller may use; each ``id`` is a valid ``model`` value."""
        data = [{"id": name, "object": "model", "created": self.started, "owned_by": "compat-server"}
                for name in self.base_models]
        for row in self.records.sampler_checkpoints(owner):
            if row["base_model"] in self.base_models:
                data.append({"id": row["tinker_path"], "object": "model", "created": _unix(row["created"]),
                             "owned_by": "you" if row["owner"] == owner else "published",
                             "root": row["base_model"], "parent": row["base_model"]})
        return {"object": "list", "data": data}

    def retrieve_model(self, owner: str, model: str) -> dict:
        for entry in self.list_models(owner)["data"]:
            if entry["id"] == model:
                return entry
        raise ModelNotFound(f"the model {model!r} does not exist; GET /v1/models lists the models you can use")

    # ---- requests -------------------------------------------------------------------------------------------------
    def prepare(self, owner: str, body: object, chat: bool) -> Prepared:
        req = parse_request(ChatRequest if chat else CompletionRequest, body)
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        target = self.sampling.resolve_model(owner, req.model)
        vocab = self.vocabulary(target.base_model)
        prompts = [vocab.render_chat(chat_messages(req))] if chat else completion_prompts(req, vocab.encode)
        jobs = []
        for prompt in prompts:
            sample, penalties = sample_request(req, prompt)
            try:
                job = decode_sample_request(sample, self.sampling.limits[target.base_model])
            except UserError as exc:
                raise OpenAIError(400, str(exc)) from None
            jobs.append(replace(job, presence_penalty=penalties.presence, frequency_penalty=penalties.frequency))
        wants_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        if req.user:
            log.debug("%s request from user %r on %s", "chat" if chat else "completion", req.user, req.model)
        return Prepared(
            chat=chat, owner=owner, model=req.model, target=target, vocab=vocab, jobs=jobs,
            logprobs=wants_logprobs, stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()))

    async def complete(self, p: Prepared) -> dict:
        """The whole response; counts against the key's ``--max-pending-per-key`` while it is sampled."""
        with self.quota.hold(p.owner):
            results: list[SampleResult] = await asyncio.gather(
                *(self.sampling.run_job(p.target, job) for job in p.jobs))
        choices = []
        for i, result in enumerate(results):
            for j, seq in enumerate(result.sequences):
                text = TextAssembler(p.vocab, p.stops).push(seq.tokens, final=True)
                choices.append(ChoiceOut(p.choice_index(i, j), text, seq.stop_reason,
                                         _logprobs(seq) if p.logprobs else None))
        used = usage(p.prompt_tokens, sum(len(seq.tokens) for result in results for seq in result.sequences))
        build = chat_completion if p.chat else text_completion
        return build(p.vocab, p.id, p.created, p.model, choices, used)

    def stream(self, p: Prepared) -> AsyncIterator[bytes]:
        """Server-sent events: (chat) each choice's role first; text deltas as tokens arrive; each choice's last delta
        with its finish_reason; the usage chunk if asked for; ``[DONE]`` (after the key's count is given back).
        Prompts of a multi-prompt completion are streamed one after the other.

        A key at its request limit is refused here, before the 200 status line goes out; the stream itself counts
        against the limit from its first event until it ends (counting inside the generator is what guarantees the
        count is given back, even when the client goes away before the stream starts)."""
        self.quota.check(p.owner)
        return self._stream(p)

    async def _stream(self, p: Prepared) -> AsyncIterator[bytes]:
        with self.quota.hold(p.owner, checked=False):  # admitted by ``stream``
            async for event in self._events(p):
                yield event
        # Sent once the count is given back: a client that has seen the end may send its next request at once.
        yield _sse("[DONE]")

    async def _events(self, p: Prepared) -> AsyncIterator[bytes]:
        header = (p.id, p.created, p.model)
        chunk = chat_chunk if p.chat else completion_chunk
        completion_tokens = 0
        try:
            for i, job in enumerate(p.jobs):
                assemblers = [TextAssembler(p.vocab, p.stops) for _ in range(job.num_samples)]
                offsets = [0] * job.num_samples
                if p.chat:
                    for j in range(job.num_samples):
                        yield _sse(chat_chunk(p.vocab, *header, index=p.choice_index(i, j),
                                              role=True, content=""))
                async for item in self.sampling.stream_job(p.target, job):
                    if isinstance(item, SampleResult):
                        for j, seq in enumerate(item.sequences):
                            done = len(assemblers[j].tokens)
                            text = assemblers[j].push(seq.tokens[done:], final=True)
                            yield _sse(chunk(p.vocab, *header, index=p.choice_index(i, j),
                                             finish_reason=seq.stop_reason,
                                             logprobs=_logprobs(seq, done) if p.logprobs and done < len(seq.tokens)
                                             else None,
                                             **self._text(p.chat, text, offsets[j])))
                            completion_tokens += len(seq.tokens)
                        continue
                    for j, events in _by_sequence(item).items():
                        text = assemblers[j].push([e.token for e in events])
                        lp = None
                        if p.logprobs:
                            lp = TokenLogprobs()
                            for event in events:
                                lp.add(event)
                        if text or lp:
                            yield _sse(chunk(p.vocab, *header, index=p.choice_index(i, j), logprobs=lp,
                                             **self._text(p.chat, text, offsets[j])))
                            offsets[j] += len(text)
            if p.include_usage:
                yield _sse(chunk(p.vocab, *header, used=usage(p.prompt_tokens, completion_tokens)))
        except (OpenAIError, UserError) as exc:
            error = exc if isinstance(exc, OpenAIError) else OpenAIError(400, str(exc))
            yield _sse(error.body())
        except Exception as exc:  # the status line is already sent: the error travels as an event
            log.exception("streaming %s failed", p.id)
            yield _sse(OpenAIError(500, f"internal server error: {exc}", kind="server_error").body())

    @staticmethod
    def _text(chat: bool, text: str, offset: int) -> dict:
        if chat:
            return {"content": text} if text else {}
        return {"text": text, "offset": offset}


def _by_sequence(events: list[TokenEvent]) -> dict[int, list[TokenEvent]]:
    grouped: dict[int, list[TokenEvent]] = {}
    for event in events:
        grouped.setdefault(event.index, []).append(event)
    return grouped
