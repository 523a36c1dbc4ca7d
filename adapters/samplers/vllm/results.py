"""What one vLLM request's stream of outputs adds up to: the ``SampleResult`` the vLLM sampler gives back, and the
tokens it streams as they arrive. Logprobs are vLLM's raw ones (``logprobs_mode="raw_logprobs"``), in vLLM's layout of
one {token id: Logprob} dict per position.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from adapters.samplers.grammar import no_next_token
from adapters.samplers.interface import OnToken
from shims.sampling.job import PromptScores, SampleJob, SampleResult, SequenceResult, TokenEvent
from shims.tinker.sampling_wire import masked_topk


class CollectedOutputs:
    """What one request's stream of vLLM outputs adds up to. A streamed (cumulative) output for ``n > 1`` holds only
    the sequences that moved in that step, so each sequence's latest state is kept by its index."""

    def __init__(self, job: SampleJob) -> None:
        self.job = job
        self.latest: dict[int, object] = {}
        self.sent: dict[int, int] = {}
        self.prompt_logprobs = None
        self.cached_tokens = 0

    def add(self, output, on_token: OnToken | None) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.cached_tokens = int(getattr(output, "num_cached_tokens", 0) or 0) or self.cached_tokens
        for completion in output.outputs:
            self.latest[completion.index] = completion
            if on_token is not None:
                self._announce(completion, on_token)

    def _announce(self, completion, on_token: OnToken) -> None:
        """Report the tokens of ``completion`` beyond those already reported (a greedy job's one sequence under each
        of its sample indices). The token a grammar rejected (see ``result``) is never reported."""
        job = self.job
        indices = range(job.num_samples) if job.greedy else (completion.index,)
        tokens, steps = list(completion.token_ids), completion.logprobs or []
        if completion.finish_reason == "error" and job.constraint is not None:
            tokens = tokens[:-1]
        for position in range(self.sent.get(completion.index, 0), len(tokens)):
            token = tokens[position]
            step = steps[position] if position < len(steps) else {}
            ids = lps = None
            if job.topk_sample_logprobs:
                ids, lps = topk_rows([step], job.topk_sample_logprobs)
            logprob = float(step[token].logprob) if token in step else float("nan")
            for index in indices:
                on_token(TokenEvent(index, token, logprob, ids, lps))
        self.sent[completion.index] = len(tokens)

    def result(self) -> SampleResult:
        """The ``SampleResult``; a greedy job's one sequence is its every sample."""
        job = self.job
        expected = 1 if job.greedy else job.num_samples
        if sorted(self.latest) != list(range(expected)):
            raise RuntimeError(f"vLLM returned sequences {sorted(self.latest)} of {expected}")
        sequences = []
        for index in range(expected):
            completion = self.latest[index]
            if completion.finish_reason == "error" and job.constraint is not None:
                # vLLM ends one request alone with "error" when its grammar rejects the token sampled: what a mask
                # that allows no token leaves (its row's logits all -inf), the sampled token being the one rejected.
                raise no_next_token(max(len(completion.token_ids) - 1, 0))
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a sequence with {completion.finish_reason!r}")
            tokens = list(completion.token_ids)
            steps = completion.logprobs or []
            seq = SequenceResult(tokens=tokens, logprobs=[float(step[t].logprob) for t, step in zip(tokens, steps)],
                                 stop_reason=completion.finish_reason)
            if job.topk_sample_logprobs:
                seq.topk_ids, seq.topk_logprobs = topk_rows(steps, job.topk_sample_logprobs)
            sequences.append(seq)
        if job.greedy:
            sequences = [replace(sequences[0]) for _ in range(job.num_samples)]
        return SampleResult(sequences=sequences, prompt=self._prompt_scores(),
                            prompt_cache_hit_tokens=self.cached_tokens)

    def _prompt_scores(self) -> PromptScores:
        job, scores = self.job, PromptScores()
        if self.prompt_logprobs is None:
            return scores
        n, first = len(job.prompt), job.first_scored
        values = np.full(n, np.nan, dtype=np.float32)
        ranks = np.zeros(n, dtype=np.int64)
        for i in range(first, n):
            own = self.prompt_logprobs[i][job.prompt[i]]
            values[i], ranks[i] = own.logprob, own.rank or 0
        scores.logprobs, scores.ranks = values, ranks
        if job.topk_prompt_logprobs:
            ids, lps = topk_rows(self.prompt_logprobs, job.topk_prompt_logprobs)
            masked_ids, masked_lps = masked_topk(first, job.topk_prompt_logprobs)
            ids[:first], lps[:first] = masked_ids, masked_lps
            scores.topk_ids, scores.topk_logprobs = ids, lps
        return scores


def topk_rows(steps, k: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM gives each position a dict {token id: Logprob(logprob, rank)} holding the top-k plus the chosen token;
    keep the k best ranks, in rank order."""
    ids, lps = masked_topk(len(steps), k)
    for i, step in enumerate(steps):
        if not step:
            continue
        best = sorted(step.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)[:k]
        for j, (token, logprob) in enumerate(best):
            ids[i, j], lps[i, j] = token, logprob.logprob
    return ids, lps


def decoded_token_counter(sampler):
    """A vLLM stat logger (its only per-step hook) that adds each step's decoded tokens to ``sampler``'s
    ``decoded_tokens``; vLLM's own periodic log lines stay off (``disable_log_stats``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class DecodedTokens(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if iteration_stats is not None:
                sampler.decoded_tokens += iteration_stats.num_generation_tokens

        def log_engine_initialized(self) -> None:
            pass

    return DecodedTokens
