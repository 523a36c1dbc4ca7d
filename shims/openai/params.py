"""An OpenAI request → the :class:`SampleJob` every sampler backend runs: OpenAI's defaults and ranges, vLLM's sampling
extensions, and the output constraint (``response_format``, vLLM's ``structured_outputs``, or a forced tool call).

The request first becomes the same ``tinker`` ``SampleRequest`` the Tinker route decodes, so both APIs share one set
of sampling checks (context size, vocabulary, sample count); the fields the Tinker wire has no place for are then set
on the job. That request names no model (``base_model``, ``model_path`` and ``sampling_session_id`` are all optional
and left unset): the route has already chosen the sampler from the request's ``model``, and the decoding reads only
the sampling fields. Pure: nothing here does I/O.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

from tinker import types

from shims.errors import UserError
from shims.openai.errors import OpenAIError
from shims.openai.limits import OpenAILimits
from shims.openai.tool_calls import ToolMode
from shims.openai.wire import ChatRequest, CompletionRequest
from shims.sampling.job import OutputConstraint, SampleJob, SamplingLimits
from shims.sampling.json_schema_limits import admits_nothing, unsupported_features
from shims.tinker.sampling_wire import decode_sample_request

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default ``max_tokens`` for ``/v1/completions``; a chat may use the rest of the context."""


def _in_range(value: float | None, low: float, high: float | None, param: str) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise OpenAIError(400, f"{param} must be {bound}, got {value}", param=param, code="invalid_value")


def _schema_constraint(schema: dict | str | None, param: str) -> OutputConstraint:
    """A constraint to ``schema`` (None: any JSON), checked now so that a schema the grammar engine cannot compile,
    one using a keyword it could not enforce, or one no finite value satisfies (whose grammar would leave its rows
    no token to sample) is the caller's 400, naming the parameter, rather than a failed sampling request or an
    output that does not validate."""
    import xgrammar

    if schema is None:
        return OutputConstraint(json_schema=None)
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        xgrammar.Grammar.from_json_schema(text, any_whitespace=True, strict_mode=True)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with the converter's message
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise OpenAIError(400, f"{param}: the JSON schema cannot be used: {message}", param=param) from None
    parsed = json.loads(text)
    if unsupported := unsupported_features(parsed):
        raise OpenAIError(400, f"{param}: the JSON schema uses what constrained decoding cannot enforce, so the "
                               f"output could not be guaranteed to follow it: {'; '.join(unsupported)}", param=param)
    if empty := admits_nothing(parsed):
        raise OpenAIError(400, f"{param}: the JSON schema {empty}", param=param)
    return OutputConstraint(json_schema=text)


def output_constraint(req: ChatRequest | CompletionRequest, tools: ToolMode) -> OutputConstraint | None:
    """What the output must be: a forced tool call's JSON, else ``response_format``, else ``structured_outputs``."""
    if tools.schema is not None:
        # Each forced tool's schema is checked where the client wrote it; the calls' schema that tool_mode built
        # around them adds nothing the grammar engine could refuse, so it is not compiled a second time here.
        for i, tool in enumerate(getattr(req, "tools", None) or []):
            if tools.kind == "required" or tool.function.name == tools.name:
                _schema_constraint(tool.function.parameters, f"tools.{i}.function.parameters")
        return OutputConstraint(json_schema=json.dumps(tools.schema))
    asked = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(_schema_constraint(None, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                              param="response_format.json_schema")
        asked.append(_schema_constraint(fmt.json_schema.json_schema, "response_format.json_schema.schema"))
    structured = req.structured_outputs
    if structured is not None:
        if structured.model_extra:
            raise OpenAIError(400, f"structured_outputs: only json and json_object are supported by this server, "
                                   f"not {', '.join(sorted(structured.model_extra))}", param="structured_outputs")
        if structured.json_ is not None:
            asked.append(_schema_constraint(structured.json_, "structured_outputs.json"))
        elif structured.json_object:
            asked.append(_schema_constraint(None, "structured_outputs.json_object"))
    if req.guided_json is not None:
        asked.append(_schema_constraint(req.guided_json, "guided_json"))
    if len(asked) > 1:
        raise OpenAIError(400, "give one of response_format, structured_outputs and guided_json",
                          param="response_format")
    return asked[0] if asked else None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise OpenAIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise OpenAIError(400, f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        _in_range(value, -100, 100, "logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


def _max_tokens(req: ChatRequest | CompletionRequest) -> int | None:
    """The asked ``max_tokens``; None lets a chat use the rest of the context. Only completions' ``echo`` may ask
    for 0 (the prompt's logprobs and nothing else)."""
    if isinstance(req, ChatRequest):
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        asked = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    least = 0 if isinstance(req, CompletionRequest) and req.echo else 1
    if asked is not None and asked < least:
        raise OpenAIError(400, f"max_tokens must be at least {least}, got {asked}", param="max_tokens")
    return asked


def sampling_job(req: ChatRequest | CompletionRequest, prompt: list[int], limits: SamplingLimits,
                 openai: OpenAILimits, constraint: OutputConstraint | None = None) -> SampleJob:
    """The checked job for one prompt of ``req``. ``max_tokens: 0`` (completions' ``echo``) samples one token, which
    the response leaves out, as vLLM does."""
    _in_range(req.temperature, 0, openai.max_temperature, "temperature")
    _in_range(req.top_p, 0, 1, "top_p")
    _in_range(req.min_p, 0, 1, "min_p")
    _in_range(req.presence_penalty, -2, 2, "presence_penalty")
    _in_range(req.frequency_penalty, -2, 2, "frequency_penalty")
    if req.repetition_penalty is not None and not (math.isfinite(req.repetition_penalty)
                                                   and req.repetition_penalty > 0):
        raise OpenAIError(400, f"repetition_penalty must be greater than 0, got {req.repetition_penalty}",
                          param="repetition_penalty")
    if req.top_k is not None and req.top_k < -1:
        raise OpenAIError(400, f"top_k must be -1 or 0 (no limit) or at least 1, got {req.top_k}", param="top_k")
    if req.n is not None and req.n < 1:
        raise OpenAIError(400, f"n must be at least 1, got {req.n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise OpenAIError(400, "stop strings must not be empty", param="stop")
    if openai.max_stop is not None and len(stops) > openai.max_stop:
        raise OpenAIError(400, f"stop takes up to {openai.max_stop} strings on this server (--max-stop-strings), "
                               f"got {len(stops)}", param="stop")
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None:
            _in_range(req.top_logprobs, 0, openai.max_logprobs, "top_logprobs")
            if not req.logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else 0
    else:
        _in_range(req.logprobs, 0, openai.max_logprobs, "logprobs")
        k = req.logprobs or 0
    _in_range(req.prompt_logprobs, 0, openai.max_logprobs, "prompt_logprobs")
    echo_logprobs = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
    max_tokens = _max_tokens(req)
    params = types.SamplingParams(
        max_tokens=max(max_tokens, 1) if max_tokens is not None else None, seed=req.seed, stop=stops or None,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if not req.top_k else req.top_k)
    sample = types.SampleRequest(
        num_samples=req.n or 1, prompt=types.ModelInput.from_ints(prompt), sampling_params=params,
        topk_sample_logprobs=k, prompt_logprobs=echo_logprobs or req.prompt_logprobs is not None,
        topk_prompt_logprobs=max(k if echo_logprobs else 0, req.prompt_logprobs or 0))
    stop_ids = list(req.stop_token_ids or [])
    if bad := [t for t in stop_ids if not 0 <= t < limits.vocab_size]:
        raise OpenAIError(400, f"stop_token_ids has token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})",
                          param="stop_token_ids")
    try:
        job = decode_sample_request(sample, limits)
    except UserError as exc:
        raise OpenAIError(400, str(exc)) from None
    return replace(
        job, stop_token_ids=tuple(stop_ids), stop_at_eos=not req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0, min_p=req.min_p or 0.0,
        logit_bias=_logit_bias(req.logit_bias, limits.vocab_size), constraint=constraint)
