"""The vLLM sampler (GPU, ``pip install -e ".[gpu]"``): vLLM's async engine with LoRA enabled.

vLLM does the batching (continuous batching across every concurrent request and adapter). Adapters are hot-loaded
from their sampler checkpoint directory by ``LoRARequest``; ``ResidentAdapters`` bounds how many stay loaded and
evicts the least recently used with ``remove_lora``. A later request for an evicted adapter simply names it again
and vLLM reloads it from disk. Logprobs are vLLM's raw logprobs (before temperature and filtering), the numbers the
trainer's ``forward`` computes for the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np

from adapters.sampler import Acquired, AdapterRef, AllAdaptersBusy, OnToken, ResidentAdapters, SamplerFacts
from shims.errors import UserError
from shims.sampling_wire import PromptScores, SampleJob, SampleResult, SequenceResult, TokenEvent, masked_topk

log = logging.getLogger("compat_server.sampler")


class VLLMSampler:
    """One base model in a vLLM ``AsyncLLM`` engine, sampled with any number of LoRA adapters."""

    def __init__(self, location: str, max_resident: int = 8, max_lora_rank: int = 64,
                 gpu_memory_utilization: float = 0.85, max_gpu_loras: int = 4) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=location, enable_lora=True, max_lora_rank=max_lora_rank, max_loras=min(max_gpu_loras, max_resident),
            max_cpu_loras=max_resident, gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
            logprobs_mode="raw_logprobs", max_logprobs=-1)
        self.engine = AsyncLLM.from_engine_args(args)
        config = self.engine.model_config
        self.max_lora_rank = max_lora_rank
        self.adapters = ResidentAdapters(max_resident)
        self._freed = asyncio.Condition()
        self._facts = SamplerFacts(backend="vllm", vocab_size=int(config.get_vocab_size()),
                                   max_context=int(config.max_model_len), device="cuda", max_resident=max_resident)

    def facts(self) -> SamplerFacts:
        return self._facts

    def resident(self) -> list[str]:
        return self.adapters.keys()

    def stats(self) -> dict:
        return {"resident_adapters": self.resident()}

    async def close(self) -> None:
        self.engine.shutdown()

    def _check_supported(self, job: SampleJob) -> None:
        if job.target is not None or job.prompt_alt_tokens_k:
            raise UserError("target_prompt_logprobs and prompt_alt_tokens_k are not supported by the vLLM sampler; "
                            "run the server with --sampler-backend transformers for them")

    def _check_rank(self, ref: AdapterRef) -> None:
        rank = int(json.loads((Path(ref.directory) / "adapter_config.json").read_text())["r"])
        if rank > self.max_lora_rank:
            raise UserError(f"LoRA rank {rank} of {ref.key} exceeds this sampler's --vllm-max-lora-rank "
                            f"{self.max_lora_rank}")

    def _params(self, job: SampleJob, streaming: bool):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        wants_prompt = job.prompt_logprobs or job.topk_prompt_logprobs > 0
        return SamplingParams(
            # vLLM raises a temperature in (0, 0.01) to 0.01; below GREEDY_TEMPERATURE every backend takes the argmax.
            # It refuses n > 1 when greedy: one sequence is decoded and ``_result`` / ``_announce`` copy it.
            n=1 if job.greedy else job.num_samples, temperature=0.0 if job.greedy else job.temperature,
            max_tokens=job.max_tokens, top_k=job.top_k or -1,
            top_p=job.top_p, seed=job.seed, stop=list(job.stop_strings) or None,
            stop_token_ids=list(job.stop_token_ids) or None, ignore_eos=not job.stop_at_eos,
            include_stop_str_in_output=True, logprobs=job.topk_sample_logprobs,
            prompt_logprobs=job.topk_prompt_logprobs if wants_prompt else None,
            presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
            output_kind=RequestOutputKind.CUMULATIVE if streaming else RequestOutputKind.FINAL_ONLY,
            detokenize=bool(job.stop_strings))

    async def sample(self, adapter: AdapterRef | None, job: SampleJob, on_token: OnToken | None = None) -> SampleResult:
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        self._check_supported(job)
        lora, slot_id = None, None
        try:
            if adapter is not None:
                self._check_rank(adapter)
                slot = await self._acquire(adapter)
                slot_id = slot.slot_id
                for evicted in slot.evicted:
                    await self.engine.remove_lora(evicted)
                    log.info("adapter evicted from vLLM sampler: lora id %d", evicted,
                             extra={"event": "adapter_evicted", "slot": evicted})
                # The name is unique per load: vLLM's prefix cache keys on it, and KV computed with older weights
                # under the same key must never be reused for newer ones.
                lora = LoRARequest(f"{adapter.key}#{slot_id}", slot_id, adapter.directory)
            final, sent = None, [0] * job.num_samples
            async for output in self.engine.generate(TokensPrompt(prompt_token_ids=list(job.prompt)),
                                                     self._params(job, on_token is not None),
                                                     request_id=uuid.uuid4().hex, lora_request=lora):
                final = output
                if on_token is not None:
                    _announce(output, job, sent, on_token)
        except Exception as exc:
            if adapter is not None and slot_id is not None and "lora" in str(exc).lower():
                self.adapters.forget(adapter.key, slot_id)
                raise UserError(f"sampler weights {adapter.key} could not be loaded by vLLM: {exc}. An adapter "
                                "trained with train_unembed=True (LoRA on lm_head) may not load in vLLM; train "
                                "with train_unembed=False or run --sampler-backend transformers") from None
            raise
        finally:
            if slot_id is not None:
                self.adapters.release(adapter.key, slot_id)
                async with self._freed:
                    self._freed.notify_all()
        return _result(final, job)

    async def _acquire(self, adapter: AdapterRef) -> Acquired:
        """Reserve a resident slot, waiting while every resident adapter serves a running request."""
        async with self._freed:
            while True:
                try:
                    return self.adapters.acquire(adapter)
                except AllAdaptersBusy:
                    await self._freed.wait()


def _result(output, job: SampleJob) -> SampleResult:
    """The ``SampleResult`` of vLLM's final output; a greedy job's one sequence is its every sample."""
    sequences = []
    for completion in output.outputs:
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a sequence with {completion.finish_reason!r}")
        tokens = list(completion.token_ids)
        steps = completion.logprobs or []
        seq = SequenceResult(tokens=tokens, logprobs=[float(step[t].logprob) for t, step in zip(tokens, steps)],
                             stop_reason=completion.finish_reason)
        if job.topk_sample_logprobs:
            seq.topk_ids, seq.topk_logprobs = _topk_rows(steps, job.topk_sample_logprobs)
        sequences.append(seq)
    if job.greedy:
        sequences = [replace(sequences[0]) for _ in range(job.num_samples)]
    scores = PromptScores()
    if output.prompt_logprobs is not None:
        n, first = len(job.prompt), job.first_scored
        values = np.full(n, np.nan, dtype=np.float32)
        for i in range(first, n):
            values[i] = output.prompt_logprobs[i][job.prompt[i]].logprob
        scores.logprobs = values
        if job.topk_prompt_logprobs:
            ids, lps = _topk_rows(output.prompt_logprobs, job.topk_prompt_logprobs)
            masked_ids, masked_lps = masked_topk(first, job.topk_prompt_logprobs)
            ids[:first], lps[:first] = masked_ids, masked_lps
            scores.topk_ids, scores.topk_logprobs = ids, lps
    return SampleResult(sequences=sequences, prompt=scores,
                        prompt_cache_hit_tokens=int(getattr(output, "num_cached_tokens", 0) or 0))


def _announce(output, job: SampleJob, sent: list[int], on_token: OnToken) -> None:
    """Report the tokens a cumulative vLLM output holds beyond those already reported (a greedy job's one sequence
    under each of its sample indices)."""
    for completion in output.outputs:
        indices = range(job.num_samples) if job.greedy else (completion.index,)
        tokens, steps = list(completion.token_ids), completion.logprobs or []
        for position in range(sent[completion.index], len(tokens)):
            token = tokens[position]
            step = steps[position] if position < len(steps) else {}
            ids = lps = None
            if job.topk_sample_logprobs:
                ids, lps = _topk_rows([step], job.topk_sample_logprobs)
            logprob = float(step[token].logprob) if token in step else float("nan")
            for index in indices:
                on_token(TokenEvent(index, token, logprob, ids, lps))
        sent[completion.index] = len(tokens)


def _topk_rows(steps, k: int) -> tuple[np.ndarray, np.ndarray]:
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
