"""The arithmetic of sampling, shared by every backend that computes logits itself: choosing the next token under
logit bias, penalties, temperature, min-p, top-k and top-p with a per-sequence random generator, scoring the prompt,
and matching stop strings. Each step is where vLLM's sampler has it, so a request means the same on every backend.

Pure torch on tensors the caller provides; no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from shims.sampling.job import PromptScores, SampleJob
from shims.tinker.sampling_wire import masked_topk


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


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> torch.Tensor:
    """The sampling distribution over one row of logits: temperature, then min-p, top-k and top-p (nucleus)
    filtering, in vLLM's order. The most likely token always keeps its place, so no ``top_p`` (however small) leaves
    nothing to draw from."""
    logits = logits.float()
    scaled = (logits - logits.max()) / temperature  # shifted first: a small temperature cannot overflow to inf
    if min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
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


def penalized(logits: torch.Tensor, job: SampleJob, previous: Sequence[int],
              prompt: torch.Tensor | None = None) -> torch.Tensor:
    """One row of logits with the job's ``logit_bias`` added, then (over the tokens this sequence has seen) vLLM's
    repetition penalty and OpenAI's frequency / presence penalties, vLLM's order. ``prompt``: the prompt's token ids
    as a tensor on the logits' device, when the caller keeps one, so a long prompt is not converted at every step;
    else they come from ``job.prompt``."""
    repeating = job.repetition_penalty != 1.0
    if not (job.logit_bias or repeating or (previous and (job.presence_penalty or job.frequency_penalty))):
        return logits
    device = logits.device
    out = logits.float().clone()
    if job.logit_bias:
        bias = dict(job.logit_bias)  # a token named twice takes its last bias, as vLLM's dict does
        out[torch.tensor(list(bias), device=device)] += torch.tensor(list(bias.values()), device=device)
    sampled = torch.tensor(previous, dtype=torch.long, device=device)
    if repeating:
        seen = torch.cat([prompt if prompt is not None else torch.tensor(job.prompt, device=device), sampled])
        seen = torch.unique(seen)
        values = out[seen]
        # As strong as float32 holds, never NaN: the penalty within float32's range (one of 1e300 is infinite there,
        # and 0 × inf is NaN) and the result too (a logit divided by 1e-40 overflows, and inf - inf is NaN later).
        finite = torch.finfo(out.dtype)
        penalty = min(max(job.repetition_penalty, finite.tiny), finite.max)
        penalized_values = torch.where(values > 0, values / penalty, values * penalty)
        out[seen] = penalized_values.clamp(max=finite.max)
    if previous and (job.presence_penalty or job.frequency_penalty):
        ids, counts = torch.unique(sampled, return_counts=True)
        out[ids] -= job.frequency_penalty * counts.float() + job.presence_penalty
    return out


def choose_token(logits: torch.Tensor, job: SampleJob, stream: SeededStream, previous: Sequence[int] = (),
                 prompt: torch.Tensor | None = None) -> int:
    """Pick the next token from one row of logits: ``penalized`` first, then the argmax when the job is greedy, else a
    draw from ``filtered_probs``. ``prompt``: as for ``penalized``."""
    logits = penalized(logits, job, previous, prompt)
    if job.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, job.temperature, job.top_k, job.top_p, job.min_p)
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
        ranks = np.zeros(n, dtype=np.int64)
        if n > 1:
            targets = torch.tensor(job.prompt[1:], device=logprobs.device).unsqueeze(1)
            own = logprobs.gather(1, targets)
            values[1:] = own.squeeze(1).float().cpu().numpy()
            ranks[1:] = ((logprobs > own).sum(dim=1) + 1).cpu().numpy()  # 1 + how many tokens were likelier
        values[:first] = np.nan
        scores.logprobs, scores.ranks = values, ranks
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
