"""The OpenAI-compatible operations: chat completions and text completions (whole here, streamed in
``completion_stream``), and the tokenizer routes.

They sample through ``SamplingService`` exactly as the Tinker ``asample`` route does (same checks, same pool, same
metrics); this module adds tokenizers, OpenAI's and vLLM's parameter rules and response objects (``shims.openai_*``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime

from adapters.models.resolve import BaseModelSpec
from compat_server.access.quotas import KeyQuota
from compat_server.records import Records
from compat_server.sampling.service import SamplingService, Target
from shims.openai.choice import ChoiceOutput
from shims.openai.errors import OpenAIError
from shims.openai.out import (
    ChoiceOut,
    TokenLogprobs,
    chat_completion,
    prompt_logprobs,
    text_completion,
    usage,
)
from shims.openai.params import OpenAILimits, output_constraint, sampling_job
from shims.openai.text import Vocabulary
from shims.openai.tool_calls import ToolMode, tool_definitions, tool_mode
from shims.openai.wire import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    completion_prompts,
    ignored_fields,
    parse_request,
)
from shims.sampling.job import SampleJob, SampleResult

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
                 quota: KeyQuota, limits: OpenAILimits) -> None:
        self.sampling = sampling
        self.quota = quota
        self.records = records
        self.base_models = base_models
        self.limits = limits
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

    def model_name(self, model: str | None) -> str:
        """``model`` as given, or the one base model when the request names none (vLLM's rule)."""
        if model:
            return model
        if len(self.base_models) == 1:
            return next(iter(self.base_models))
        raise OpenAIError(400, f"missing required parameter: 'model' (this server has {len(self.base_models)} base "
                               "models; GET /v1/models lists them)", param="model", code="missing_required_parameter")

    # ---- requests -------------------------------------------------------------------------------------------------
    def prepare(self, owner: str, body: object, chat: bool) -> Prepared:
        req = parse_request(ChatRequest if chat else CompletionRequest, body)
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        model = self.model_name(req.model)
        target = self.sampling.weights.for_model(owner, model)
        vocab = self.vocabulary(target.base_model)
        tools = tool_mode(req) if chat else ToolMode()
        if chat:
            prompts = [vocab.render_chat(chat_messages(req.messages), tools=tool_definitions(req),
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         template_kwargs=req.chat_template_kwargs)]
        else:
            prompts = completion_prompts(req, lambda text: vocab.encode(text, req.add_special_tokens))
        constraint = output_constraint(req, tools)
        limits = self.sampling.limits[target.base_model]
        jobs = [sampling_job(req, prompt, limits, self.limits, constraint) for prompt in prompts]
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
        """The whole response; counts against the key's ``--max-pending-per-key`` while it is sampled."""
        with self.quota.hold(p.owner):
            results: list[SampleResult] = await asyncio.gather(
                *(self.sampling.run_job(p.target, job) for job in p.jobs))
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

    # ---- models ---------------------------------------------------------------------------------------------------
    def list_models(self, owner: str) -> dict:
        """Base models, then every sampler checkpoint the caller may use; each ``id`` is a valid ``model`` value, and
        ``max_model_len`` is its context (as vLLM's model cards give it)."""
        data = [{"id": name, "object": "model", "created": self.started, "owned_by": "compat-server",
                 "root": name, "parent": None, "max_model_len": self.sampling.limits[name].max_context}
                for name in self.base_models]
        for row in self.records.checkpoints.sampler_checkpoints(owner):
            if row["base_model"] in self.base_models:
                data.append({"id": row["tinker_path"], "object": "model", "created": _unix(row["created"]),
                             "owned_by": "you" if row["owner"] == owner else "published",
                             "root": row["base_model"], "parent": row["base_model"],
                             "max_model_len": self.sampling.limits[row["base_model"]].max_context})
        return {"object": "list", "data": data}

    def retrieve_model(self, owner: str, model: str) -> dict:
        for entry in self.list_models(owner)["data"]:
            if entry["id"] == model:
                return entry
        raise OpenAIError(404, f"the model {model!r} does not exist; GET /v1/models lists the models you can use",
                          param="model", code="model_not_found")


def _unix(stamp: str) -> int:
    return int(datetime.fromisoformat(stamp).timestamp())
