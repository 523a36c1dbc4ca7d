"""The sampling operations behind the Tinker routes: sampling sessions, ``asample`` and ephemeral sampler weights.

A sampling session names what to sample from: a base model, a saved sampler checkpoint, or weights saved without a
name by ``save_weights_and_get_sampling_client`` (a ``snapshot``, or the training model's shared ``inflight``
weights). ``asample`` checks the request, answers a future at once (with one sequence id per sample, which the SDK
requires), and runs it on the sampler pool. Every so often a sampled sequence is re-scored by the trainer to measure
how far the sampler's logprobs drift from the trainer's for the same tokens.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from tinker import types

from adapters.models.resolve import BaseModelSpec
from adapters.samplers.interface import AdapterRef
from adapters.samplers.pool import SamplerPool
from compat_server.jobs.futures import PROTOBUF, Payload, poll_group
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import Records
from compat_server.runs.checkpoint_store import CheckpointStore, parse_path
from compat_server.sampling.ephemeral import EphemeralWeights
from compat_server.sampling.stability import StabilityStore
from compat_server.sampling.stats import SamplingMeter
from compat_server.telemetry import tracer
from shims.errors import NotFound, UserError
from shims.sampling.job import SampleJob, SampleResult, SamplingLimits, TokenEvent
from shims.tinker.sampling_wire import decode_sample_request, encode_sample_response

log = logging.getLogger("compat_server.sampling")


class ModelNotFound(NotFound):
    """A model name or path that names nothing this caller may sample (the OpenAI routes answer 404)."""


def _base_weights() -> AdapterRef | None:
    return None


@dataclass(frozen=True)
class Target:
    """What one request samples from: a base model, and the weights on it. ``weights()`` is called when the request
    runs and checks again, at that moment, that the caller may still use them: a checkpoint unpublished, deleted,
    saved again under its name or expired since the request (or its sampling session) began is refused then."""

    base_model: str
    owner: str
    """The key it samples for: its metrics count the request."""
    weights: Callable[[], AdapterRef | None] = _base_weights


@dataclass(frozen=True)
class SamplingOptions:
    max_num_samples: int = 128
    max_logprobs_k: int = 64
    drift_probe_every: int = 50
    """Re-score one sampled sequence with the trainer every this many sample requests per base model (0: never)."""
    ephemeral_keep: int = 8
    """Unnamed sampler saves (snapshots and inflight versions) kept on disk per training model."""
    stability_ttl_seconds: float = 86400.0
    """How long recorded stability info stays usable after its last use (Tinker: one day)."""


def sampler_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


class SamplingService:
    """Tinker sampling calls for one server."""

    def __init__(self, records: Records, scheduler: Scheduler, samplers: SamplerPool, checkpoints: CheckpointStore,
                 ephemeral_root: Path, base_models: dict[str, BaseModelSpec], options: SamplingOptions) -> None:
        self.records = records
        self.scheduler = scheduler
        self.samplers = samplers
        self.checkpoints = checkpoints
        self.base_models = base_models
        self.options = options
        self.stability = StabilityStore(records, options.stability_ttl_seconds)
        self.limits = {
            name: SamplingLimits(vocab_size=facts.vocab_size, max_context=facts.max_context,
                                 max_num_samples=options.max_num_samples, max_logprobs_k=options.max_logprobs_k)
            for name, facts in samplers.facts.items()
        }
        self.meter = SamplingMeter(list(base_models), options.drift_probe_every, self._score)
        self.ephemeral = EphemeralWeights(ephemeral_root, options.ephemeral_keep)

    # ---- sampling sessions ----------------------------------------------------------------------------------------
    def create_sampling_session(self, owner: str, req: types.CreateSamplingSessionRequest) -> str:
        if self.records.session(req.session_id, owner) is None:
            raise NotFound(f"unknown session_id {req.session_id!r}")
        sampler_id = sampler_id_for(req.session_id, req.sampling_session_seq_id)
        existing = self.records.sampler(sampler_id, owner)
        if existing is not None:  # a retried request: the same answer, nothing created twice
            if existing["model_path"] != req.model_path or (req.base_model and existing["base_model"] != req.base_model):
                raise UserError(f"sampling session {sampler_id} already exists with different weights")
            return sampler_id
        if req.model_path:
            ckpt, ref = self._sampler_checkpoint(owner, req.model_path)
            if req.base_model and req.base_model != ckpt["base_model"]:
                raise UserError(f"{req.model_path} was trained on {ckpt['base_model']}, not {req.base_model}")
            self.records.create_sampler(sampler_id, session_id=req.session_id, owner=owner,
                                        base_model=ckpt["base_model"], kind="checkpoint", model_path=req.model_path,
                                        adapter_key=ref.key, adapter_dir=ref.directory, checkpoint_uid=ckpt["uid"])
        elif req.base_model:
            self._base(req.base_model)
            self.records.create_sampler(sampler_id, session_id=req.session_id, owner=owner,
                                        base_model=req.base_model, kind="base")
        else:
            raise UserError("create_sampling_session needs a base_model or a model_path")
        log.info("sampling session created: %s (%s)", sampler_id, req.model_path or req.base_model)
        return sampler_id

    def get_sampler(self, owner: str, sampler_id: str) -> types.GetSamplerResponse:
        row = self.records.sampler(sampler_id, owner)
        if row is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        return types.GetSamplerResponse(sampler_id=sampler_id, base_model=row["base_model"],
                                        model_path=row["model_path"])

    def _base(self, name: str) -> BaseModelSpec:
        spec = self.base_models.get(name)
        if spec is None:
            raise UserError(f"unknown base model {name!r}; this server serves: {', '.join(self.base_models)}")
        return spec

    def _sampler_checkpoint(self, owner: str, path: str, uid: str | None = None) -> tuple[dict, AdapterRef]:
        """The checkpoint's record and the weights it names, checked now (given ``uid``: still that save). The key
        and directory are the save's own, so weights saved again under a reused name are never mistaken for the
        ones a sampler already holds."""
        parsed = parse_path(path)
        if parsed.checkpoint_type != "sampler":
            held = "training state (weights/)" if parsed.checkpoint_type == "training" else "exported weights"
            raise UserError(f"{path} holds {held}; sample from sampler weights instead: save them with "
                            "save_weights_for_sampler and use the tinker://…/sampler_weights/… path it returns")
        ckpt, directory = self.checkpoints.readable(self.records, owner, path, "sampler checkpoint", uid)
        self._base(ckpt["base_model"])  # trained on a base model this server no longer serves
        return ckpt, AdapterRef(f"{path}@{ckpt['uid']}", str(directory))

    async def _score(self, base_model: str, adapter: AdapterRef | None, tokens: list[int]) -> list[float]:
        """The trainer's logprobs of ``tokens`` under the same weights (for the drift probe)."""
        return await self.scheduler.trainer(base_model, "score", adapter.directory if adapter else None, tokens)

    # ---- ephemeral sampler weights ---------------------------------------------------------------------------------
    def register_ephemeral(self, owner: str, model_row: dict, sampling_session_seq_id: int | None, kind: str,
                           directory: Path) -> str:
        """Record a sampling session over weights just saved into ``directory`` (``self.ephemeral.directory``)."""
        if sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler without a name needs sampling_session_seq_id")
        ref = self.ephemeral.add(model_row["id"], kind, directory)
        sampler_id = sampler_id_for(model_row["session_id"], sampling_session_seq_id)
        self.records.create_sampler(sampler_id, session_id=model_row["session_id"], owner=owner,
                                    base_model=model_row["base_model"], kind=kind, model_id=model_row["id"],
                                    adapter_key=ref.key, adapter_dir=str(directory))
        log.info("sampler weights saved (%s): %s → sampling session %s", kind, model_row["id"], sampler_id)
        return sampler_id

    # ---- asample --------------------------------------------------------------------------------------------------
    def _resolve(self, owner: str, req: types.SampleRequest) -> tuple[Target, dict | None]:
        """What the request samples from, checked now (and again when it runs), and its sampling session's row
        (None for a request naming base_model / model_path directly)."""
        if req.sampling_session_id is not None:
            row = self.records.sampler(req.sampling_session_id, owner)
            if row is None:
                raise NotFound(f"unknown sampling session {req.sampling_session_id!r}")
            target = Target(row["base_model"], owner, lambda: self._session_weights(owner, row["id"]))
        elif req.model_path:
            target = self._checkpoint_target(owner, req.model_path)
            row = None
        elif req.base_model:
            target, row = Target(self._base(req.base_model).name, owner), None
        else:
            raise UserError("a sample request needs a sampling_session_id, a model_path or a base_model")
        target.weights()
        return target, row

    def _checkpoint_target(self, owner: str, path: str) -> Target:
        """A sampler checkpoint readable by ``owner`` now, as a target that stays on this very save."""
        ckpt, _ = self._sampler_checkpoint(owner, path)
        return Target(ckpt["base_model"], owner, lambda: self._sampler_checkpoint(owner, path, ckpt["uid"])[1])

    def _session_weights(self, owner: str, sampler_id: str) -> AdapterRef | None:
        """The weights of a sampling session, re-read and re-checked at each use (inflight weights may have moved;
        the checkpoint a session was opened on may have been unpublished, deleted, replaced or expired)."""
        row = self.records.sampler(sampler_id, owner)
        if row is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        if row["kind"] == "base":
            return None
        if row["kind"] == "checkpoint":
            return self._sampler_checkpoint(owner, row["model_path"], row["checkpoint_uid"] or "")[1]
        if row["kind"] == "inflight":
            ref = self.ephemeral.inflight(row["model_id"])
            if ref is None:
                raise UserError(f"the inflight weights of sampling session {row['id']} are gone (the server "
                                "restarted); save weights for sampling again")
            return ref
        if not Path(row["adapter_dir"]).exists():
            raise UserError(f"the weights of sampling session {row['id']} are gone: the server keeps the last "
                            f"{self.options.ephemeral_keep} unnamed saves per training model (--ephemeral-keep) and "
                            "none across restarts; save weights for sampling again")
        return AdapterRef(row["adapter_key"], row["adapter_dir"])

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
            target, row = self._resolve(owner, req)
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
    def resolve_model(self, owner: str, model: str) -> Target:
        """An OpenAI ``model`` value → what to sample: a base model name, a ``tinker://…/sampler_weights/…`` path,
        or ``<base>;<path>``. Unknown names raise ``ModelNotFound``."""
        base_name, _, path = model.rpartition(";")
        if not path.startswith("tinker://"):
            if path not in self.base_models:
                raise ModelNotFound(f"the model {model!r} does not exist; GET /v1/models lists the models you can use")
            return Target(path, owner)
        try:
            target = self._checkpoint_target(owner, path)
        except UserError as exc:
            raise ModelNotFound(str(exc)) from None
        if base_name and base_name != target.base_model:
            raise UserError(f"{path} was trained on {target.base_model}, not {base_name}")
        return target

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
            described = {"backend": facts[name].backend, "device": facts[name].device, "dtype": facts[name].dtype}
            if owner is None:
                out[name] = {**self.meter.server[name].as_dict(), **described, "replicas": pool[name]}
            else:
                out[name] = {**self.meter.of_key(name, owner).as_dict(), **described}
        return out
