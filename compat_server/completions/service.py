"""The OpenAI-compatible operations: chat completions and text completions (whole here, streamed in
``compat_server.completions.stream``), and the tokenizer routes.

They sample through ``SamplingService`` exactly as the Tinker ``asample`` route does (same checks, same pool, same
metrics); this module adds tokenizers, OpenAI's and vLLM's parameter rules and response objects (``shims.openai``).
Tokenizing, chat templates and decoding run in ``workers`` (threads), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime

from adapters.models.resolve import BaseModelSpec
from compat_server.access.quotas import KeyQuota
from compat_server.completions.workers import TokenWorkers
from compat_server.records import Records
from compat_server.sampling.service import SamplingService, Target
from shims.errors import NotFound
from shims.openai.choice import ChoiceOutput
from shims.openai.errors import OpenAIError
from shims.openai.limits import OpenAILimits
from shims.openai.out import (
    ChoiceOut,
    TokenLogprobs,
    chat_completion,
    prompt_logprobs,
    text_completion,
    usage,
)
from shims.openai.params import output_constraint, sampling_job
from shims.openai.text import PromptLimit, Vocabulary, longest_token_chars
from shims.openai.tool_calls import ToolMode, tool_definitions, tool_mode
from shims.openai.wire import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    completion_inputs,
    ignored_fields,
    parse_request,
)
from shims.sampling.job import SampleJob, SampleResult, SamplingLimits

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
    tools: ToolMode = field(default_factory=ToolMode)
    echo: bool = False
    sampled_shown: bool = True
    """False for completions' ``max_tokens: 0`` with ``echo``: the one token sampled is not part of the answer."""
    include_stop: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: bool = False
    ignored: list[str] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(job.prompt) for job in self.jobs)

    def choice_index(self, prompt: int, sample: int) -> int:
        return prompt * self.jobs[0].num_samples + sample

    def output(self) -> ChoiceOutput:
        return ChoiceOutput(self.vocab, self.jobs[0].stop_strings, self.tools, include_stop=self.include_stop,
                            skip_special_tokens=self.skip_special_tokens)

    def echoed(self, job: SampleJob, result: SampleResult) -> tuple[str, TokenLogprobs | None]:
        """The prompt's text (and logprobs) that ``echo`` puts before a choice's own."""
        if not self.echo:
            return "", None
        text = self.vocab.decode(job.prompt, self.skip_special_tokens)
        lps = TokenLogprobs.of_prompt(job.prompt, result.prompt) if self.logprobs else None
        return text, lps


class CompletionsService:
    def __init__(self, sampling: SamplingService, records: Records, base_models: dict[str, BaseModelSpec],
                 quota: KeyQuota, limits: OpenAILimits, workers: TokenWorkers) -> None:
        self.sampling = sampling
        self.quota = quota
        self.records = records
        self.base_models = base_models
        self.limits = limits
        """``max_prompt_chars`` None: each model's context × its longest token (``PromptLimit``)."""
        self.workers = workers
        self.started = int(time.time())
        self._vocabs: dict[str, Vocabulary] = {}

    async def vocabulary(self, base_model: str) -> Vocabulary:
        """The base model's tokenizer, loaded (in a worker: a large tokenizer takes a while) at its first use."""
        if base_model not in self._vocabs:
            vocab = await self.workers.run(self._load_vocabulary, base_model)
            self._vocabs.setdefault(base_model, vocab)
        return self._vocabs[base_model]

    def _load_vocabulary(self, base_model: str) -> Vocabulary:
        from transformers import AutoTokenizer

        # From where the server loads the model: ``tokenizer_id`` is the name given to clients, which for the
        # built-in model would send the hub library looking for it online first.
        tokenizer = AutoTokenizer.from_pretrained(self.base_models[base_model].location)
        max_context = self.sampling.limits[base_model].max_context
        if self.limits.max_prompt_chars is not None:
            limit = PromptLimit(self.limits.max_prompt_chars, max_context, "--max-prompt-chars")
        else:
            limit = PromptLimit(max_context * longest_token_chars(tokenizer), max_context)
        vocab = Vocabulary(tokenizer, limit)
        # The first call may set the tokenizer's truncation and padding state; made here, before any two threads
        # share the tokenizer (the Rust tokenizer refuses a change while another thread is encoding).
        vocab.decode(vocab.encode("warm up"))
        return vocab

    def limits_of(self, target: Target) -> SamplingLimits:
        """What a request on ``target`` may ask: its base model's limits, at the context its model id asked for."""
        limits = self.sampling.limits[target.base_model]
        return limits if target.context is None else replace(limits, max_context=target.context)

    def model_name(self, model: str | None) -> str:
        """``model`` as given, or the one base model when the request names none (vLLM's rule)."""
        if model:
            return model
        if len(self.base_models) == 1:
            return next(iter(self.base_models))
        raise OpenAIError(400, f"missing required parameter: 'model' (this server has {len(self.base_models)} base "
                               "models; GET /v1/models lists them)", param="model", code="missing_required_parameter")

    # ---- requests -------------------------------------------------------------------------------------------------
    async def prepare(self, owner: str, body: object, chat: bool) -> Prepared:
        """The checked request. Its chat template, its prompts' tokenizing and its output constraint run in the
        workers, a completion's prompts one by one: a request of many long prompts takes turns with the others.
        A key at its ``--max-pending-per-key`` is refused first, before any of that work is done for it (and so
        while the requests that fill its count are still running: its tokenizer's first load can take seconds)."""
        self.quota.check(owner)
        req = parse_request(ChatRequest if chat else CompletionRequest, body)
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        model = self.model_name(req.model)
        target = self.sampling.weights.for_model(owner, model)
        vocab = await self.vocabulary(target.base_model)
        tools = tool_mode(req) if chat else ToolMode()
        if chat:
            prompts = [await self.workers.run(_render_chat, vocab, req)]
        else:
            prompts = [await self.workers.run(vocab.encode, p, req.add_special_tokens) if isinstance(p, str) else p
                       for p in completion_inputs(req)]
        limits = self.limits_of(target)
        jobs = await self.workers.run(_sampling_jobs, req, tools, prompts, limits, self.limits)
        if ignored := ignored_fields(req):
            log.debug("%s request: ignored fields %s", "chat" if chat else "completion", ", ".join(ignored))
        echo = not chat and req.echo
        return Prepared(
            chat=chat, owner=owner, model=model, target=target, vocab=vocab, jobs=jobs,
            logprobs=bool(req.logprobs) if chat else req.logprobs is not None, stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()), tools=tools,
            echo=echo, sampled_shown=not (echo and req.max_tokens == 0),
            include_stop=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            prompt_logprobs=req.prompt_logprobs is not None, ignored=ignored)

    async def complete(self, p: Prepared) -> dict:
        """The whole response; counts against the key's ``--max-pending-per-key`` while it is sampled. Its text is
        decoded in a worker (``n`` choices of up to the context each)."""
        with self.quota.hold(p.owner):
            results: list[SampleResult] = await asyncio.gather(
                *(self.sampling.run_job(p.target, job) for job in p.jobs))
        return await self.workers.run(_answer, p, results)

    # ---- models ---------------------------------------------------------------------------------------------------
    def list_models(self, owner: str) -> dict:
        """Base models, then every sampler checkpoint (and sampleable external one) the caller may use; each ``id`` is a valid ``model`` value, and
        ``max_model_len`` is its context (as vLLM's model cards give it)."""
        data = [{"id": name, "object": "model", "created": self.started, "owned_by": "compat-server",
                 "root": name, "parent": None, "max_model_len": self.sampling.limits[name].max_context}
                for name in self.base_models]
        for row in self.records.checkpoints.sampler_checkpoints(owner):
            if row["base_model"] in self.base_models and self.sampling.weights.sampleable(row):
                data.append({"id": row["tinker_path"], "object": "model", "created": _unix(row["created"]),
                             "owned_by": "you" if row["owner"] == owner else "published",
                             "root": row["base_model"], "parent": row["base_model"],
                             "max_model_len": self.sampling.limits[row["base_model"]].max_context})
        return {"object": "list", "data": data}

    def retrieve_model(self, owner: str, model: str) -> dict:
        """The model card of ``model`` in any form a request may name it (``shims.openai.model_ids``): a listed id's
        card as listed, another form's (``<base>;<path>``, a ``:peft:<n>`` context) with its own id and context."""
        for entry in self.list_models(owner)["data"]:
            if entry["id"] == model:
                return entry
        try:
            target = self.sampling.weights.for_model(owner, model)
        except NotFound:
            raise OpenAIError(404, f"the model {model!r} does not exist; GET /v1/models lists the models you can "
                                   "use", param="model", code="model_not_found") from None
        base = target.base_model
        return {"id": model, "object": "model", "created": self.started, "owned_by": "compat-server", "root": base,
                "parent": None if model == base else base, "max_model_len": self.limits_of(target).max_context}


def _render_chat(vocab: Vocabulary, req: ChatRequest) -> list[int]:
    """The chat's prompt: its messages (and tools) through the model's chat template, tokenized."""
    return vocab.render_chat(chat_messages(req.messages), tools=tool_definitions(req),
                             add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             template_kwargs=req.chat_template_kwargs)


def _sampling_jobs(req: ChatRequest | CompletionRequest, tools: ToolMode, prompts: list[list[int]],
                   limits: SamplingLimits, openai: OpenAILimits) -> list[SampleJob]:
    """One checked job per prompt, under the request's output constraint (whose grammar is compiled here)."""
    constraint = output_constraint(req, tools)
    return [sampling_job(req, prompt, limits, openai, constraint) for prompt in prompts]


def _answer(p: Prepared, results: list[SampleResult]) -> dict:
    """The whole response from the sampled results: each choice's text, tool calls and logprobs."""
    choices, completion_tokens = [], 0
    for i, (job, result) in enumerate(zip(p.jobs, results)):
        prefix, prefix_lps = p.echoed(job, result)
        prompt_lps = prompt_logprobs(p.vocab, job.prompt, result.prompt) if p.prompt_logprobs else None
        for j, seq in enumerate(result.sequences):
            tokens = seq.tokens if p.sampled_shown else []
            completion_tokens += len(tokens)
            out = p.output()
            content, calls = out.push(tokens, final=True)
            lps = TokenLogprobs.of_sequence(seq, len(seq.tokens) - len(tokens)) if p.logprobs else None
            if prefix_lps is not None:
                lps = prefix_lps + lps
            reason = out.finish_reason(seq.stop_reason if p.sampled_shown else "length")
            choices.append(ChoiceOut(p.choice_index(i, j), (content or None) if calls else prefix + content,
                                     reason, lps, calls or None, None if p.chat else prompt_lps))
    used = usage(p.prompt_tokens, completion_tokens)
    if p.chat:  # one prompt: its logprobs go on the response rather than on each choice
        return chat_completion(p.vocab, p.id, p.created, p.model, choices, used, prompt_lps)
    return text_completion(p.vocab, p.id, p.created, p.model, choices, used)


def _unix(stamp: str) -> int:
    return int(datetime.fromisoformat(stamp).timestamp())
