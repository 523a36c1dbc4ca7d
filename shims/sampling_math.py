"""The arithmetic of sampling, shared by every backend that computes logits itself: choosing the next token under
temperature / top-k / top-p with a per-sequence random generator, scoring the prompt, and matching stop strings.

Pure torch on tensors the caller provides; no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from shims.sample_job import PromptScores, SampleJob
from shims.sampling_wire import masked_topk


class SeededStream:
    """One sequence's random stream. Its ``torch.Generator`` is made on the device of the tensors it draws for, when
    it first meets them: a CUDA tensor cannot be sampled with a CPU generator (and copying every distribution to the
    host to draw there would cost a transfer per token). The same seed gives the same draws on the same device."""

    def __init__(self, seed: int) -> None:
        self.seed = seed % 2**63
        self._generator: torch.Generator | None = None

    def on(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator


def sequence_streams(job: SampleJob, fallback_seed: int) -> list[SeededStream]:
    """One stream per requested sample. With a seed, sample ``i`` always draws from ``seed``'s ``i``-th stream, so the
    same request with the same seed gives the same tokens whatever else is batched with it."""
    base = job.seed if job.seed is not None else fallback_seed
    return [SeededStream(base * 1_000_003 + i) for i in range(job.num_samples)]


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution over one row of logits: temperature, then top-k, then top-p (nucleus) filtering.
    The most likely token always keeps its place, so no ``top_p`` (however small) leaves nothing to draw from."""
    logits = logits.float()
    scaled = (logits - logits.max()) / temperature  # shifted first: a small temperature cannot overflow to inf
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        dropped = before >= top_p  # keep the smallest set reaching top_p
        dropped[0] = False
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def penalized(logits: torch.Tensor, job: SampleJob, previous: Sequence[int]) -> torch.Tensor:
    """OpenAI's presence / frequency penalties over the tokens this sequence has sampled so far."""
    if not (job.presence_penalty or job.frequency_penalty) or not previous:
        return logits
    ids, counts = torch.unique(torch.tensor(previous, device=logits.device), return_counts=True)
    out = logits.float().clone()
    out[ids] -= job.frequency_penalty * counts.float() + job.presence_penalty
    return out


def choose_token(logits: torch.Tensor, job: SampleJob, stream: SeededStream, previous: Sequence[int] = ()) -> int:
    """Pick the next token from one row of logits: argmax when the job is greedy, else a draw from ``filtered_probs``;
    penalties (if any) first."""
    logits = penalized(logits, job, previous)
    if job.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, job.temperature, job.top_k, job.top_p)
    return int(torch.multinomial(probs, 1, generator=stream.on(probs.device)))


def top_k(logprobs: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    values, ids = torch.topk(logprobs, k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), values.float().cpu().numpy()


def score_prompt(logprobs: torch.Tensor, job: SampleJob, stream: SeededStream) -> PromptScores:
    """Prompt-side results from the prefill. ``logprobs[i]`` is the log-softmax (temperature 1) of the logits at
    prompt position ``i``, i.e. the distribution over prompt token ``i + 1``; shape ``[len(prompt) - 1, vocab]``."""
    n = len(job.prompt)
    scores = PromptScores()
    first = job.first_scored
    if job.prompt_logprobs:
        values = np.full(n, np.nan, dtype=np.float32)
        if n > 1:
            targets = torch.tensor(job.prompt[1:], device=logprobs.device).unsqueeze(1)
            values[1:] = logprobs.gather(1, targets).squeeze(1).float().cpu().numpy()
        values[:first] = np.nan
        scores.logprobs = values
    if job.topk_prompt_logprobs:
        ids, values = masked_topk(n, job.topk_prompt_logprobs)
        if n > 1:
            ids[1:], values[1:] = top_k(logprobs, job.topk_prompt_logprobs)
        masked_ids, masked_values = masked_topk(first, job.topk_prompt_logprobs)
        ids[:first], values[:first] = masked_ids, masked_values
        scores.topk_ids, scores.topk_logprobs = ids, values
    if job.target is not None:
        ids = torch.tensor(job.target.ids, device=logprobs.device)
        gathered = logprobs.gather(1, ids.clamp(min=0)).float()
        scores.target_logprobs = torch.where(ids >= 0, gathered, 0.0).cpu().numpy()
    if job.prompt_alt_tokens_k:
        k = job.prompt_alt_tokens_k
        if job.greedy:
            draws = torch.argmax(logprobs, dim=-1, keepdim=True).expand(-1, k)
        else:
            probs = torch.softmax(logprobs.float() / job.temperature, dim=-1)
            draws = torch.multinomial(probs, k, replacement=True, generator=stream.on(probs.device))
        scores.alt_tokens = draws.cpu().numpy().astype(np.int64)
        scores.alt_logprobs = logprobs.gather(1, draws).float().cpu().numpy()
    return scores


class StopMatcher:
    """Decides when one sequence stops: on a stop token id, the end-of-sequence token (unless ``stop=[]`` turned every
    stop off), or a stop string appearing in the decoded text. The token that completes a stop is kept in the
    sequence, as the tinker SDK's renderers expect when they parse a response."""

    def __init__(self, job: SampleJob, eos_ids: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        self.stop_ids = set(job.stop_token_ids) | (set(eos_ids) if job.stop_at_eos else set())
        self.strings = job.stop_strings
        self.decode = decode
        self._longest = max((len(s) for s in self.strings), default=0)
        self._checked = 0

    def done(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.stop_ids:
            return True
        if not self.strings:
            return False
        text = self.decode(tokens)
        window = text[max(0, self._checked - self._longest):]
        self._checked = len(text)
        return any(s in window for s in self.strings)
