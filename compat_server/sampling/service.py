"""The sampling operations behind the Tinker routes and the OpenAI ones: running sample jobs on the sampler pool.

A sampling session names what to sample from (``sessions``): a base model, a saved sampler checkpoint, or weights
saved without a name by ``save_weights_and_get_sampling_client`` (a ``snapshot``, or the training model's shared
``inflight`` weights); ``weights`` resolves what a request samples. ``asample`` checks the request, answers a future
at once (with one sequence id per sample, which the SDK requires), and runs it on the sampler pool. Every so often a
sampled sequence is re-scored by the trainer to measure how far the sampler's logprobs drift from the trainer's for
the same tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from tinker import types

from adapters.models.resolve import BaseModelSpec
from adapters.samplers.interface import AdapterRef
from adapters.samplers.pool import SamplerPool
from compat_server.jobs.futures import PROTOBUF, Payload, poll_group
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import Records
from compat_server.runs.checkpoint_store import CheckpointStore
from compat_server.sampling.ephemeral import EphemeralWeights
from compat_server.sampling.options import SamplingOptions
from compat_server.sampling.sessions import SamplingSessions
from compat_server.sampling.stability import StabilityStore
from compat_server.sampling.stats import SamplingMeter
from compat_server.sampling.weights import ModelNotFound, SamplerWeights, Target
from compat_server.telemetry import tracer
from shims.errors import UserError
from shims.sampling.job import SampleJob, SampleResult, SamplingLimits, TokenEvent
from shims.tinker.sampling_wire import decode_sample_request, encode_sample_response

__all__ = ["ModelNotFound", "SamplingOptions", "SamplingService", "Target"]


class SamplingService:
    """Tinker sampling calls for one server: sampling sessions (``sessions``), what a request samples (``weights``)
    and running sample jobs on the pool, counted in the metrics."""

    def __init__(self, records: Records, scheduler: Scheduler, samplers: SamplerPool, checkpoints: CheckpointStore,
                 ephemeral_root: Path, base_models: dict[str, BaseModelSpec], options: SamplingOptions) -> None:
        self.scheduler = scheduler
        self.samplers = samplers
        self.base_models = base_models
        self.options = options
        self.stability = StabilityStore(records, options.stability_ttl)
        self.limits = {
            name: SamplingLimits(vocab_size=facts.vocab_size, max_context=facts.max_context,
                                 max_num_samples=options.max_num_samples, max_logprobs_k=options.max_logprobs_k)
            for name, facts in samplers.facts.items()
        }
        self.meter = SamplingMeter(list(base_models), options.drift_probe_every, self._score)
        self.ephemeral = EphemeralWeights(ephemeral_root, options.ephemeral_keep, options.ephemeral_memory_mb * 2**20)
        self.weights = SamplerWeights(records, checkpoints, self.ephemeral, base_models,
                                      {name: limits.max_context for name, limits in self.limits.items()})
        self.sessions = SamplingSessions(records, self.weights, self.ephemeral)

    # ---- the drift probe ------------------------------------------------------------------------------------------
    async def _score(self, base_model: str, adapter: AdapterRef | None, tokens: list[int]) -> list[float]:
        """The trainer's logprobs of ``tokens`` under the same weights (for the drift probe)."""
        weights = None if adapter is None else adapter.directory or adapter.tensors  # Ray hands the trainer its value
        return await self.scheduler.trainer_for(base_model).score(weights, tokens)

    # ---- asample --------------------------------------------------------------------------------------------------
    def asample(self, owner: str, req: types.SampleRequest, idem: str | None) -> dict:
        """Answer ``{request_id, sample_sequence_ids}`` at once; a bad request answers a future failed as a user
        error, like the training routes."""
        group = None
        if req.sampling_session_id is not None and req.seq_id is not None:
            prefix = f"{req.sampling_session_id}:{req.seq_id}"
            group = poll_group(req.sampling_session_id, req.seq_id)
        else:  # a one-off request outside a sampling session
            prefix = f"sample-{uuid.uuid4().hex}"
        count = max(0, min(req.num_samples, self.options.max_num_samples))
        sequence_ids = [f"{prefix}:{i}" for i in range(count)]
        try:
            target, row = self.weights.for_request(owner, req)
            job = decode_sample_request(req, self.limits[target.base_model])
            if job.record_stability_info and row is None:
                raise UserError("record_stability_info needs a sampling session (stability info belongs to the "
                                "session that sampled it): sample through a sampling client")
        except UserError as exc:
            request_id = self.scheduler.fail_now(owner=owner, kind="sample", message=str(exc), idempotency_key=idem,
                                                 poll_group=group)
            return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

        async def run() -> Payload:
            result = await self.run_job(target, job)
            if job.record_stability_info:
                self.stability.record(owner, row["session_id"], sequence_ids, job.prompt,
                                      [(s.tokens, s.logprobs) for s in result.sequences])
            return Payload(PROTOBUF, encode_sample_response(result, job))

        request_id = self.scheduler.submit(owner=owner, kind="sample", job=run, idempotency_key=idem, poll_group=group)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    # ---- the one sampling path (Tinker asample and the OpenAI routes) --------------------------------------------
    async def run_job(self, target: Target, job: SampleJob) -> SampleResult:
        """Sample ``job`` on the pool, counting it in the metrics (the server's and its key's)."""
        base_model = target.base_model
        with self.meter.running(base_model, target.owner), tracer.start_as_current_span("sampler.sample", attributes={
                "compat_server.base_model": base_model, "compat_server.num_samples": job.num_samples}):
            adapter = target.weights()
            result = await self.samplers.sample(base_model, adapter, job)
        self.meter.count(base_model, target.owner, adapter, job, result)
        return result

    async def stream_job(self, target: Target, job: SampleJob) -> AsyncIterator[list[TokenEvent] | SampleResult]:
        """``run_job``, yielding lists of tokens as they are sampled before the result."""
        base_model = target.base_model
        with self.meter.running(base_model, target.owner), tracer.start_as_current_span("sampler.stream", attributes={
                "compat_server.base_model": base_model, "compat_server.num_samples": job.num_samples}):
            adapter = target.weights()
            async for item in self.samplers.stream(base_model, adapter, job):
                if isinstance(item, SampleResult):
                    self.meter.count(base_model, target.owner, adapter, job, item)
                yield item

    async def metrics(self, owner: str | None = None) -> dict:
        """Per base model: the server's figures and its sampler replicas (``owner`` None: an operator), or one
        key's own figures and no replica details (another tenant's load and adapters are not its business)."""
        facts = self.samplers.facts
        pool = await self.samplers.stats() if owner is None else {}
        out = {}
        for name in self.base_models:
            described = {"backend": facts[name].backend, "device": facts[name].device, "dtype": facts[name].dtype,
                         "tensor_parallel_size": facts[name].tensor_parallel_size}
            if owner is None:
                out[name] = {**self.meter.server[name].as_dict(), **described, "replicas": pool[name]}
            else:
                out[name] = {**self.meter.of_key(name, owner).as_dict(), **described}
        return out
