"""The training operations behind the Tinker routes: what each request does to records, checkpoints and trainers.

Routes parse HTTP and call one method here; each method checks what it can at once and hands the rest to the
scheduler as a job, returning the future's JSON (``{"request_id", "model_id"}``) immediately.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime, timedelta

from tinker import types

from adapters.base_models import BaseModelSpec
from adapters.disk import DiskFull
from adapters.trainer import MAX_LORA_RANK, AdamHyper, LoraSpec, StepRequest, read_lora_spec, read_saved_step
from compat_server.checkpoints import CheckpointStore, parse_path, tinker_path
from compat_server.futures import JSON, PROTOBUF, Payload
from compat_server.records import Records
from compat_server.sampling import SamplingService
from compat_server.scheduler import Scheduler
from compat_server.telemetry import TOKENS_TRAINED
from shims.errors import NotFound, UserError
from shims.training_wire import ForwardBackwardBatch, encode_forward_backward_output

log = logging.getLogger("compat_server.training")


def json_payload(model: types.BaseModel) -> Payload:
    return Payload(JSON, model.model_dump_json(exclude_none=True).encode())


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id format the SDK itself assumes when it creates a training client from saved state."""
    return f"{session_id}:train:{model_seq_id}"


class RolledBack(RuntimeError):
    """The run was rolled back to a checkpoint after a trainer crash: its owner's first request after that fails
    with this, saying from where and what was lost, so that no training silently repeats or skips steps."""


@contextmanager
def disk_full_names(what: str) -> Iterator[None]:
    """A full disk while saving says what was being saved and what to do (nothing of the run is lost)."""
    try:
        yield
    except DiskFull as exc:
        raise DiskFull(f"no space left on device while saving {what} ({exc}); the run is unchanged: free space on "
                       "the checkpoint storage (--storage-dir / --data-dir) and save again") from None


class TrainingService:
    """Tinker training calls for one server: create, train, save, load and unload LoRA models."""

    def __init__(self, records: Records, scheduler: Scheduler, checkpoints: CheckpointStore,
                 base_models: dict[str, BaseModelSpec], sampling: SamplingService,
                 max_adapters_per_key: int | None = None, max_lora_rank: int = MAX_LORA_RANK) -> None:
        self.records = records
        self.max_lora_rank = max_lora_rank
        self.max_adapters_per_key = max_adapters_per_key
        self._creating: dict[str, int] = {}
        self._last_step: dict[str, int] = {}
        """Each run's optimizer step, to say how many a rollback lost."""
        self.sampling = sampling
        self.scheduler = scheduler
        self.checkpoints = checkpoints
        self.base_models = base_models

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _future(self, request_id: str, model_id: str | None = None) -> dict:
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def _owned_model(self, owner: str, model_id: str) -> dict:
        row = self.records.model(model_id, owner)
        if row is None:
            raise NotFound(f"unknown model_id {model_id!r}")
        if row["status"] != "active":
            raise UserError(f"model {model_id} is {row['status']}; create a new training client")
        return row

    def _ordered_row(self, owner: str, model_id: str) -> dict:
        """The run for a request in its turn: owned and active, and — once after a rollback — ``RolledBack``."""
        row = self._owned_model(owner, model_id)
        notice = self.records.take_rollback_notice(model_id)
        if notice is not None:
            raise RolledBack(notice)
        return row

    @contextmanager
    def _new_model_slot(self, owner: str) -> Iterator[None]:
        """Admit one more loaded model for ``owner`` under ``--max-adapters-per-key``. Creations still running count
        too, so concurrent creates cannot slip past the limit together."""
        creating = self._creating.get(owner, 0)
        loaded = self.records.active_model_count(owner) + creating
        if self.max_adapters_per_key is not None and loaded >= self.max_adapters_per_key:
            raise UserError(f"this key already has {loaded} training runs loaded (--max-adapters-per-key "
                            f"{self.max_adapters_per_key}); unload one (save its state first to keep it) or end its "
                            "session, then create this one")
        self._creating[owner] = creating + 1
        try:
            yield
        finally:
            self._creating[owner] -= 1
            if not self._creating[owner]:
                del self._creating[owner]

    def _base(self, name: str) -> BaseModelSpec:
        spec = self.base_models.get(name)
        if spec is None:
            raise UserError(f"unknown base model {name!r}; this server serves: {', '.join(self.base_models)}")
        return spec

    def _ordered(self, owner: str, kind: str, model_id: str, seq_id: int | None, idem: str | None, job) -> dict:
        """Queue ``job(model_row)`` in the model's seq order; an unknown model fails the future as a user error."""
        try:
            self._owned_model(owner, model_id)
        except UserError as exc:
            return self._future(self.scheduler.fail_now(owner=owner, kind=kind, message=str(exc),
                                                        idempotency_key=idem), model_id)

        async def run() -> Payload:
            return await job(self._ordered_row(owner, model_id))  # re-read: it may have been unloaded meanwhile

        request_id = self.scheduler.submit(owner=owner, kind=kind, job=run, model_id=model_id, seq_id=seq_id,
                                           idempotency_key=idem)
        return self._future(request_id, model_id)

    async def expire_sessions(self, timeout_seconds: float) -> int:
        """End sessions that stopped heartbeating ``timeout_seconds`` ago: their models leave the trainer (their
        saved checkpoints stay; load one to continue). Returns how many sessions ended."""
        cutoff = (datetime.now(UTC) - timedelta(seconds=timeout_seconds)).isoformat()
        stale = self.records.stale_sessions(cutoff)
        for session in stale:
            models = self.records.active_models_of(session["id"])
            for row in models:
                try:
                    await self.scheduler.trainer(row["base_model"], "unload", row["id"])
                except Exception as exc:  # noqa: BLE001 - the model is gone from the trainer either way
                    log.warning("unloading %s of expired session %s: %s", row["id"], session["id"], exc)
                self.records.set_model_status(row["id"], "unloaded (its session expired; load a checkpoint of it "
                                                         "into a new training client to continue)")
            self.records.finish_session(session["id"], "expired")
            log.info("session expired: %s (no heartbeat since %s); models unloaded: %s", session["id"],
                     session["last_heartbeat"], ", ".join(row["id"] for row in models) or "none")
        return len(stale)

    async def reload_after_restart(self, base_model: str) -> None:
        """The base model's trainer crashed and came back empty: put every active run back from its latest training
        checkpoint (with its optimizer state). Steps after that checkpoint are lost; a run that never saved state
        cannot come back and is marked unloaded."""
        for row in self.records.active_models_on(base_model):
            saved = [c for c in self.records.run_checkpoints(row["id"]) if c["kind"] == "training"]
            if not saved:
                self.records.set_model_status(row["id"], "unloaded (the trainer restarted and this run had no saved "
                                                         "state; create a new training client)")
                log.warning("run %s lost in the trainer restart: it had no saved state", row["id"])
                continue
            path, uid = saved[-1]["tinker_path"], saved[-1]["uid"]
            try:
                await self._load(base_model, row["id"], path, uid, True)
            except Exception as exc:  # noqa: BLE001 - one run that cannot be reloaded must not stop the others
                self.records.set_model_status(row["id"], f"unloaded (reloading {path} after a trainer restart "
                                                         f"failed: {exc})")
                log.warning("run %s could not be reloaded from %s: %s", row["id"], path, exc)
                continue
            notice = self._rollback_notice(row["id"], path, read_saved_step(self.checkpoints.directory(path, uid)))
            self.records.set_rolled_back(row["id"], notice)
            log.warning("run %s reloaded from %s after the trainer restart: %s", row["id"], path, notice,
                        extra={"event": "run_rolled_back", "model_id": row["id"], "checkpoint": path})

    def _rollback_notice(self, model_id: str, path: str, saved_step: int | None) -> str:
        last = self._last_step.get(model_id)
        if saved_step is None or last is None:
            lost = "the optimizer steps and accumulated gradients after it were lost"
        else:
            lost = (f"{last - saved_step} optimizer step(s) after it were lost (it was saved at step {saved_step}; "
                    f"the run had reached step {last}), and any gradients accumulated since the last step")
        self._last_step[model_id] = saved_step or 0
        return (f"the trainer crashed and restarted, and run {model_id} was rolled back to its checkpoint {path}: "
                f"{lost}. It trains on from that checkpoint; repeat the lost steps if you need them")

    def metrics(self) -> dict:
        """Per base model: how many forward / forward_backward requests the trainer ran, in how many batches."""
        trainers = self.scheduler.trainers
        return {name: {**counts, "mean_requests_per_batch": counts["requests"] / counts["batches"] if counts["batches"]
                       else None, "node": trainers.facts[name].node, "pid": trainers.facts[name].pid}
                for name, counts in trainers.batch_counts.items()}

    # ---- create / info / unload -----------------------------------------------------------------------------------
    def create_model(self, owner: str, req: types.CreateModelRequest, idem: str | None) -> dict:
        model_id = model_id_for(req.session_id, req.model_seq_id)

        async def job() -> Payload:
            if self.records.session(req.session_id, owner) is None:
                raise NotFound(f"unknown session_id {req.session_id!r}")
            base = self._base(req.base_model)
            if req.lora_config is None:
                raise UserError("lora_config is required: this server trains LoRA adapters")
            if req.optimizer_config.type != "adamw":
                raise UserError(f"optimizer {req.optimizer_config.type!r} is not supported; use adamw")
            if self.records.model(model_id, owner) is not None:
                raise UserError(f"model {model_id} already exists")
            lora = req.lora_config
            spec = LoraSpec(rank=lora.rank, seed=lora.seed if lora.seed is not None else secrets.randbelow(2**31),
                            train_mlp=lora.train_mlp, train_attn=lora.train_attn, train_unembed=lora.train_unembed)
            spec.validate()
            if spec.rank > self.max_lora_rank:
                raise UserError(f"LoRA rank {spec.rank} is above this server's --max-lora-rank {self.max_lora_rank} "
                                "(the samplers are started for ranks up to it); ask for a smaller rank")
            with self._new_model_slot(owner):
                await self.scheduler.trainer(base.name, "create", model_id, spec)
                self.records.create_model(model_id, session_id=req.session_id, owner=owner, base_model=base.name,
                                          lora=asdict(spec), user_metadata=req.user_metadata)
            log.info("model created: %s on %s (LoRA rank %d)", model_id, base.name, spec.rank,
                     extra={"event": "model_created", "model_id": model_id, "base_model": base.name,
                            "lora_rank": spec.rank})
            return json_payload(types.CreateModelResponse(model_id=model_id))

        return self._future(self.scheduler.submit(owner=owner, kind="create_model", job=job,
                                                  idempotency_key=idem), model_id)

    def get_info(self, owner: str, model_id: str) -> types.GetInfoResponse:
        row = self.records.model(model_id, owner)
        if row is None:
            raise NotFound(f"unknown model_id {model_id!r}")
        base = self.base_models[row["base_model"]]
        facts = self.scheduler.trainers.facts[base.name]
        return types.GetInfoResponse(
            type="get_info", model_id=model_id, is_lora=True, lora_rank=row["lora_rank"], model_name=base.name,
            model_data=types.ModelData(arch=facts.arch, model_name=base.name, tokenizer_id=base.tokenizer_id),
        )

    def unload_model(self, owner: str, model_id: str, idem: str | None) -> dict:
        async def job(row: dict) -> Payload:
            await self.scheduler.trainer(row["base_model"], "unload", model_id)
            self.records.set_model_status(model_id, "unloaded")
            log.info("model unloaded: %s", model_id)
            return json_payload(types.UnloadModelResponse(model_id=model_id, type="unload_model"))

        return self._ordered(owner, "unload_model", model_id, None, idem, job)

    def reject(self, owner: str, kind: str, model_id: str, seq_id: int | None, message: str, idem: str | None) -> dict:
        """Fail a request with a user error in its model's turn, so later requests of that model are not held up."""
        async def job(row: dict) -> Payload:
            raise UserError(message)

        return self._ordered(owner, kind, model_id, seq_id, idem, job)

    # ---- training -------------------------------------------------------------------------------------------------
    def forward_backward(self, owner: str, batch: ForwardBackwardBatch, idem: str | None) -> dict:
        kind = "forward" if batch.forward_only else "forward_backward"

        async def job(row: dict) -> Payload:
            data = self.sampling.stability.attach(owner, row["session_id"], batch.loss_fn, batch.data)
            result = await self.scheduler.forward_backward(row["base_model"], StepRequest(
                batch.model_id, data, batch.loss_fn, batch.loss_fn_config, batch.forward_only))
            speed = result.num_tokens / max(result.seconds, 1e-9)
            TOKENS_TRAINED.add(result.num_tokens, {"base_model": row["base_model"], "kind": kind})
            self.records.add_step(batch.model_id, seq_id=batch.seq_id, kind=kind, loss_fn=batch.loss_fn,
                                  metrics=result.metrics, num_tokens=result.num_tokens, tokens_per_s=speed)
            log.info("%s done: %s seq %d, %s %s, %d tokens, %.0f tokens/s", kind, batch.model_id, batch.seq_id,
                     batch.loss_fn, " ".join(f"{k}={v:.4f}" for k, v in result.metrics.items()), result.num_tokens,
                     speed, extra={"event": f"{kind}_done", "model_id": batch.model_id, "seq_id": batch.seq_id,
                                   "loss_fn": batch.loss_fn, "metrics": result.metrics,
                                   "tokens": result.num_tokens, "tokens_per_s": round(speed, 1)})
            return Payload(PROTOBUF, encode_forward_backward_output(result.outputs, result.metrics))

        return self._ordered(owner, kind, batch.model_id, batch.seq_id, idem, job)

    def optim_step(self, owner: str, req: types.OptimStepRequest, idem: str | None) -> dict:
        async def job(row: dict) -> Payload:
            if not isinstance(req.optim_params, types.AdamParams):
                raise UserError(f"optimizer params of type {req.optim_params.type!r} are not supported; use adam_params")
            hyper = AdamHyper(**req.optim_params.model_dump())
            metrics = await self.scheduler.trainer(row["base_model"], "optim_step", req.model_id, hyper)
            self._last_step[req.model_id] = int(metrics["step"])
            log.info("optim_step done: %s step %d (lr %g, grad_norm %.4f)", req.model_id, int(metrics["step"]),
                     hyper.learning_rate, metrics["grad_norm"],
                     extra={"event": "optim_step_done", "model_id": req.model_id, "step": int(metrics["step"]),
                            "learning_rate": hyper.learning_rate, "grad_norm": metrics["grad_norm"]})
            return json_payload(types.OptimStepResponse(metrics=metrics))

        return self._ordered(owner, "optim_step", req.model_id, req.seq_id, idem, job)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    async def _save(self, owner: str, row: dict, kind: str, name: str, method: str, overwrite: bool,
                    ttl_seconds: int | None, user_metadata: dict | None) -> str:
        """Have the trainer write a checkpoint into staging, then publish and record it."""
        model_id = row["id"]
        path = tinker_path(model_id, kind, name)
        if self.records.live_checkpoint(path) is not None and not overwrite:
            raise UserError(f"checkpoint {path} already exists; choose another name")
        expires = self.checkpoints.expiry(ttl_seconds)
        staging, uid = self.checkpoints.staging(path), self.checkpoints.new_uid()
        try:
            with disk_full_names(path):
                await self.scheduler.trainer(row["base_model"], method, model_id, str(staging))
                size = self.checkpoints.publish(staging, path, uid)
        finally:
            self.checkpoints.discard(staging)
        replaced = self.records.add_checkpoint(path, uid=uid, training_run_id=model_id,
                                               checkpoint_id=parse_path(path).checkpoint_id, kind=kind, owner=owner,
                                               base_model=row["base_model"], size_bytes=size, expires_at=expires,
                                               user_metadata=user_metadata)
        if replaced is not None:  # overwritten, or expired and not yet swept: its files go now
            self.checkpoints.delete(path, replaced["uid"])
        log.info("checkpoint saved: %s (%d bytes)", path, size,
                 extra={"event": "checkpoint_saved", "model_id": model_id, "path": path, "bytes": size})
        return path

    def save_weights(self, owner: str, req: types.SaveWeightsRequest, idem: str | None) -> dict:
        async def job(row: dict) -> Payload:
            name = req.path or f"seq-{req.seq_id or 0:06d}"
            path = await self._save(owner, row, "training", name, "save_state", req.overwrite, req.ttl_seconds,
                                    req.user_metadata)
            return json_payload(types.SaveWeightsResponse(path=path, type="save_weights"))

        return self._ordered(owner, "save_weights", req.model_id, req.seq_id, idem, job)

    def save_weights_for_sampler(self, owner: str, req: types.SaveWeightsForSamplerRequest, idem: str | None) -> dict:
        async def job(row: dict) -> Payload:
            if req.path is None:
                return await self._save_unnamed_for_sampler(owner, row, req)
            path = await self._save(owner, row, "sampler", req.path, "save_for_sampler", False, req.ttl_seconds,
                                    req.user_metadata)
            return json_payload(types.SaveWeightsForSamplerResponse(path=path, type="save_weights_for_sampler"))

        return self._ordered(owner, "save_weights_for_sampler", req.model_id, req.seq_id, idem, job)

    def save_weights_external(self, owner: str, req: types.SaveWeightsExternalRequest, idem: str | None) -> dict:
        """The adapter as a standard PEFT directory under ``external_weights/``, for download with
        ``get_external_weights_urls``."""
        async def job(row: dict) -> Payload:
            if req.age_encryption_recipients:
                raise UserError("age_encryption_recipients is not supported by this server: the files are served "
                                "only to holders of a signed URL; encrypt them after download if needed")
            path = await self._save(owner, row, "external", req.path, "save_for_sampler", False, req.ttl_seconds,
                                    None)
            return json_payload(types.SaveWeightsExternalResponseInternal(path=path, type="save_weights_external"))

        return self._ordered(owner, "save_weights_external", req.model_id, req.seq_id, idem, job)

    async def _save_unnamed_for_sampler(self, owner: str, row: dict, req: types.SaveWeightsForSamplerRequest) -> Payload:
        """``save_weights_and_get_sampling_client``: weights saved outside the checkpoint listing, and a sampling
        session over them that can sample at once."""
        directory = self.sampling.ephemeral_directory(row["id"])
        staging = directory.with_name(f".staging-{directory.name}")
        try:
            with disk_full_names(f"sampler weights of {row['id']}"):
                await self.scheduler.trainer(row["base_model"], "save_for_sampler", row["id"], str(staging))
            staging.rename(directory)
        finally:
            self.checkpoints.discard(staging)
        sampler_id = self.sampling.register_ephemeral(owner, row, req.sampling_session_seq_id, req.kind, directory)
        return json_payload(types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id,
                                                                        type="save_weights_for_sampler"))

    def load_weights(self, owner: str, req: types.LoadWeightsRequest, idem: str | None) -> dict:
        """Load a checkpoint into an existing model (``load_state``) or into a new one (``create_training_client_
        from_state``, which names the model by session and client number and sends no create_model)."""
        if req.model_id is None:
            if req.session_id is None or req.model_seq_id is None:
                return self._future(self.scheduler.fail_now(
                    owner=owner, kind="load_weights", idempotency_key=idem,
                    message="load_weights needs model_id, or session_id and model_seq_id"))
            return self._load_into_new_model(owner, req, idem)

        async def job(row: dict) -> Payload:
            ckpt = self._readable_checkpoint(owner, req.path)
            if ckpt["base_model"] != row["base_model"]:
                raise UserError(f"checkpoint {req.path} was trained on {ckpt['base_model']}, "
                                f"but model {req.model_id} uses {row['base_model']}")
            spec = await self._load(row["base_model"], req.model_id, req.path, ckpt["uid"], req.optimizer)
            self.records.set_model_lora(req.model_id, asdict(spec))
            return json_payload(types.LoadWeightsResponse(path=req.path, model_id=req.model_id, type="load_weights"))

        return self._ordered(owner, "load_weights", req.model_id, req.seq_id, idem, job)

    def _load_into_new_model(self, owner: str, req: types.LoadWeightsRequest, idem: str | None) -> dict:
        model_id = model_id_for(req.session_id, req.model_seq_id)

        async def job() -> Payload:
            if self.records.session(req.session_id, owner) is None:
                raise NotFound(f"unknown session_id {req.session_id!r}")
            if self.records.model(model_id, owner) is not None:
                raise UserError(f"model {model_id} already exists")
            ckpt = self._readable_checkpoint(owner, req.path)
            if req.base_model and req.base_model != ckpt["base_model"]:
                raise UserError(f"checkpoint {req.path} was trained on {ckpt['base_model']}, not {req.base_model}")
            base = self._base(ckpt["base_model"])
            with self._new_model_slot(owner):
                spec: LoraSpec = await self._load(base.name, model_id, req.path, ckpt["uid"], req.optimizer)
                self.records.create_model(model_id, session_id=req.session_id, owner=owner, base_model=base.name,
                                          lora=asdict(spec), user_metadata=req.user_metadata)
            log.info("model created from %s: %s on %s", req.path, model_id, base.name,
                     extra={"event": "model_created", "model_id": model_id, "base_model": base.name,
                            "from_checkpoint": req.path})
            return json_payload(types.LoadWeightsResponse(path=req.path, model_id=model_id, type="load_weights"))

        return self._future(self.scheduler.submit(owner=owner, kind="load_weights", job=job,
                                                  idempotency_key=idem), model_id)

    def _readable_checkpoint(self, owner: str, path: str) -> dict:
        return self.checkpoints.readable(self.records, owner, path)[0]

    async def _load(self, base_model: str, model_id: str, path: str, uid: str, with_optimizer: bool) -> LoraSpec:
        """Load save ``uid`` of ``path`` (checked by the caller just before): its own directory, so a save made
        meanwhile under the same name is never what gets loaded."""
        directory = self.checkpoints.directory(path, uid)
        if not directory.exists():
            raise NotFound(f"checkpoint {path} not found (deleted while the request waited)")
        spec = read_lora_spec(directory)
        await self.scheduler.trainer(base_model, "load_state", model_id, str(directory), with_optimizer)
        log.info("weights loaded: %s ← %s (%s optimizer state)", model_id, path, "with" if with_optimizer else "without")
        return spec

