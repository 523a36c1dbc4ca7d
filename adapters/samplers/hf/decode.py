"""One batch of the transformers sampler, decoded: the rows of every request prefilled together (left-padded), the
prompts scored where a request asks, then one token per row per step with a shared KV cache; a row that finishes
(stop, length, constraint complete, or its caller gone) leaves the cache at once.

Split from ``adapters.samplers.hf.sampler``, which owns the model, the adapters and the batching: this module only
turns a batch into results, through the ``forward`` it is given (the model with each row's adapter routed).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adapters.samplers.grammar import ConstrainedSequence, JsonGrammars
from adapters.samplers.interface import AdapterRef, OnToken
from shims.errors import UserError
from shims.sampling.arithmetic import SeededStream, StopMatcher, choose_token, score_prompt, sequence_streams, top_k
from shims.sampling.job import SampleJob, SampleResult, SequenceResult, TokenEvent

Forward = Callable[..., Any]
"""``forward(adapter_names, input_ids=…, **model_kwargs)``: the model's output with row i under adapter i."""


@dataclass(frozen=True)
class BatchRequest:
    adapter: AdapterRef | None
    job: SampleJob
    on_token: OnToken | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the caller stopped waiting (its HTTP client went away): its rows leave the batch at the next
    step instead of decoding to ``max_tokens``."""


@dataclass
class _Row:
    request: int
    index: int
    """Which of its request's samples this row is."""
    adapter_name: str | None
    """The adapter's slot name, None for the base model."""
    stream: SeededStream
    matcher: StopMatcher
    grammar: ConstrainedSequence | None
    """Where the row stands in its job's output constraint, if it has one."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple] = field(default_factory=list)
    stop_reason: str | None = None


@dataclass
class BatchDecoder:
    """What decoding needs of the sampler: its forward pass and its tokenizer's facts; and its count of decoded
    tokens, kept as each is decoded so that a reader sees a long batch progress (and its tokens counted if it fails)."""

    forward: Forward
    device: torch.device
    pad_id: int
    eos_ids: list[int]
    decode: Callable[[list[int]], str]
    grammars: JsonGrammars
    decoded_tokens: int = 0
    """Every token decoded, including those of requests whose caller later went away."""

    def generate(self, requests: list[BatchRequest], names: list[str | None]) -> list[SampleResult | Exception]:
        """Each request's result, in order, or the exception that request alone fails with; ``names[i]`` is the
        adapter slot of ``requests[i]``. Whatever one request's rows do (a grammar that cannot be built or leaves no
        token, logits that are not finite, an error reporting a token), its rows leave the batch and the other rows
        decode on as they would have alone: every row's arithmetic is its own."""
        jobs = [request.job for request in requests]
        failed: dict[int, Exception] = {}
        rows: list[_Row] = []
        for number, (job, name) in enumerate(zip(jobs, names)):
            try:
                rows += [_Row(number, index, name, stream, StopMatcher(job, self.eos_ids, self.decode),
                              self.grammars.for_job(job, self.eos_ids))
                         for index, stream in enumerate(sequence_streams(job, secrets.randbits(62)))]
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                failed[number] = exc
        results = [SampleResult(sequences=[]) for _ in requests]
        if rows:
            self._decode(requests, rows, results, failed)
        for row in rows:
            if row.request not in failed:
                results[row.request].sequences.append(_sequence(row))
        return [failed.get(number, result) for number, result in enumerate(results)]

    def _decode(self, requests: list[BatchRequest], rows: list[_Row], results: list[SampleResult],
                failed: dict[int, Exception]) -> None:
        """Prefill ``rows`` together, then decode one token per row per step until every row has stopped; a request
        whose row fails is put in ``failed`` and all its rows leave the batch."""
        jobs = [request.job for request in requests]
        # The prompts the repetition penalty reads, made into tensors once rather than at every step.
        prompts = [torch.tensor(job.prompt, device=self.device) if job.repetition_penalty != 1.0 else None
                   for job in jobs]
        ids, mask = self._left_padded([jobs[row.request].prompt for row in rows])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt = any(job.needs_prompt_scores for job in jobs)
        out = self.forward([r.adapter_name for r in rows], input_ids=ids, attention_mask=mask, position_ids=positions,
                           use_cache=True, logits_to_keep=0 if want_prompt else 1)
        if want_prompt:
            self._score_prompts(out.logits, rows, jobs, results, failed)
        cache, last = out.past_key_values, out.logits[:, -1]
        active = list(range(len(rows)))  # row numbers still generating, in cache order
        next_pos = positions[:, -1] + 1
        while True:
            usable = _usable(last)
            step_tokens = []
            for slot, r in enumerate(active):
                row = rows[r]
                step_tokens.append(self.pad_id)  # replaced by the row's token; a row without one leaves below
                if row.request in failed:
                    continue
                if requests[row.request].cancelled.is_set():
                    row.stop_reason = "cancelled"
                    continue
                try:
                    if not usable[slot]:
                        raise _not_finite(row)
                    step_tokens[-1] = self._next_token(row, requests[row.request], last[slot], prompts[row.request])
                except Exception as exc:  # noqa: BLE001 - this request's own failure; the other rows go on
                    failed[row.request] = exc
                    continue
                self.decoded_tokens += 1
            keep = [slot for slot, r in enumerate(active) if rows[r].stop_reason is None and rows[r].request not in
                    failed]
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[index]
                step_tokens = [step_tokens[s] for s in keep]
                active = [active[s] for s in keep]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = self.forward([rows[r].adapter_name for r in active],
                               input_ids=torch.tensor(step_tokens, device=self.device).unsqueeze(1),
                               attention_mask=mask, position_ids=next_pos.unsqueeze(1), past_key_values=cache,
                               use_cache=True)
            cache, last = out.past_key_values, out.logits[:, -1]
            next_pos = next_pos + 1

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts as one batch of ids, padded on the left, and its attention mask."""
        longest = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, longest - len(prompt):] = torch.tensor(prompt)
            mask[i, longest - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    @staticmethod
    def _score_prompts(logits: torch.Tensor, rows: list[_Row], jobs: list[SampleJob], results: list[SampleResult],
                       failed: dict[int, Exception]) -> None:
        """Each job's prompt scores that asks for them, from its first row's prefill logits (all the logits kept);
        a job whose scoring fails is put in ``failed``."""
        longest = logits.shape[1]
        first_row: dict[int, int] = {}
        for i, row in enumerate(rows):
            first_row.setdefault(row.request, i)
        for index, i in first_row.items():
            job = jobs[index]
            if job.needs_prompt_scores:
                n = len(job.prompt)
                try:
                    logprobs = torch.log_softmax(logits[i, longest - n:longest - 1].float(), dim=-1)
                    # Its own stream, so asking for prompt_alt_tokens never changes the sampled tokens.
                    seed = job.seed if job.seed is not None else secrets.randbits(62)
                    results[index].prompt = score_prompt(logprobs, job, SeededStream(seed ^ 0x5EED))
                except Exception as exc:  # noqa: BLE001 - this request's own failure
                    failed[index] = exc

    @staticmethod
    def _next_token(row: _Row, request: BatchRequest, logits: torch.Tensor, prompt: torch.Tensor | None) -> int:
        """Choose ``row``'s next token from its logits (under its grammar, if any), record it with the model's own
        logprobs, tell the request's listener, and mark the row stopped if it is done."""
        job = request.job
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # the model's own, whatever is chosen
        allowed = logits if row.grammar is None else row.grammar.masked(logits)
        token = choose_token(allowed, job, row.stream, row.tokens, prompt)
        row.tokens.append(token)
        if row.grammar is not None:
            row.grammar.accept(token)
        row.logprobs.append(float(logprobs[token]))
        if job.topk_sample_logprobs:
            row.topk.append(top_k(logprobs.unsqueeze(0), job.topk_sample_logprobs))
        if request.on_token is not None:
            top_ids, top_lps = row.topk[-1] if job.topk_sample_logprobs else (None, None)
            request.on_token(TokenEvent(row.index, token, row.logprobs[-1], top_ids, top_lps))
        if row.matcher.done(row.tokens) or (row.grammar is not None and row.grammar.terminated):
            row.stop_reason = "stop"
        elif len(row.tokens) >= job.max_tokens:
            row.stop_reason = "length"
        return token


def _usable(logits: torch.Tensor) -> list[bool]:
    """Per row of the step's logits, whether it can be sampled from: no NaN, no +inf and some finite value (one
    check for the whole batch, so one read from the device per step)."""
    return (~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1) & torch.isfinite(logits).any(dim=-1)).tolist()


def _not_finite(row: _Row) -> Exception:
    """The error of a row whose logits are not finite. Rows are computed apart, so only this row's own input or
    adapter made them so: with an adapter (the tenant's weights) it is the caller's error, with the base model alone
    the server's."""
    if row.adapter_name is None:
        return RuntimeError("the base model's logits for this request are not finite (NaN or infinite)")
    return UserError("the model's logits for this request are not finite (NaN or infinite): the sampler weights it "
                     "names hold NaN or infinite values, or values so large that they overflow")


def _sequence(row: _Row) -> SequenceResult:
    seq = SequenceResult(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason)
    if row.topk:
        seq.topk_ids = np.concatenate([ids for ids, _ in row.topk])
        seq.topk_logprobs = np.concatenate([lps for _, lps in row.topk])
    return seq
