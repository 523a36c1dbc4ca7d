"""Saving and loading checkpoints of training runs, and putting runs back after a trainer crash."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path

from tinker import types

from adapters.disk import DiskFull, writing
from adapters.lora.layout import read_saved_step
from adapters.samplers.interface import fetched
from adapters.trainer.interface import LoraSpec, Trainer, read_lora_spec
from compat_server.jobs.futures import Payload
from compat_server.jobs.scheduler import Finishing
from compat_server.runs.checkpoint_store import CheckpointStore, parse_path, tinker_path
from compat_server.runs.encryption import encrypt_directory, parse_recipients
from compat_server.sampling.service import SamplingService
from compat_server.training.core import TrainingCore, json_payload, model_id_for
from shims.errors import NotFound, UserError

log = logging.getLogger("compat_server.training")


@contextmanager
def disk_full_names(what: str) -> Iterator[None]:
    """A full disk while saving says what was being saved and what to do (nothing of the run is lost)."""
    try:
        yield
    except DiskFull as exc:
        raise DiskFull(f"no space left on device while saving {what} ({exc}); the run is unchanged: free space on "
                       "the checkpoint storage (--storage-dir / --data-dir) and save again") from None


class CheckpointCalls:
    """save_state / save_weights_for_sampler / save_weights_external / load_state, and the reload after a crash.
    ``TrainingService`` holds one and hands these calls to it; the runs' lookups and ordering are the shared
    ``TrainingCore``'s."""

    def __init__(self, core: TrainingCore, checkpoints: CheckpointStore, sampling: SamplingService) -> None:
        self.core = core
        self.records = core.records
        self.scheduler = core.scheduler
        self.checkpoints = checkpoints
        self.sampling = sampling
        self._writing: dict[str, asyncio.Task] = {}
        """Each run's named sampler save whose files are being written after its turn (``_save_named_for_sampler``)."""
        self._naming: set[str] = set()
        """The tinker paths of those saves: taken, though not yet recorded."""

    async def reload_after_restart(self, base_model: str) -> None:
        """The base model's trainer crashed and came back empty: put every active run back from its latest training
        checkpoint (with its optimizer state). Steps after that checkpoint are lost; a run that never saved state
        cannot come back and is marked unloaded."""
        for row in self.records.runs.active_models_on(base_model):
            saved = [c for c in self.records.checkpoints.run_checkpoints(row["id"]) if c["kind"] == "training"]
            if not saved:
                self.records.runs.set_model_status(
                    row["id"], "unloaded (the trainer restarted and this run had no saved state; create a new training "
                    "client)")
                log.warning("run %s lost in the trainer restart: it had no saved state", row["id"])
                continue
            path, uid = saved[-1]["tinker_path"], saved[-1]["uid"]
            try:
                await self._load(base_model, row["id"], path, uid, True)
            except Exception as exc:  # noqa: BLE001 - one run that cannot be reloaded must not stop the others
                self.records.runs.set_model_status(row["id"], f"unloaded (reloading {path} after a trainer restart "
                                                         f"failed: {exc})")
                log.warning("run %s could not be reloaded from %s: %s", row["id"], path, exc)
                continue
            notice = self._rollback_notice(row["id"], path, read_saved_step(self.checkpoints.directory(path, uid)))
            self.records.runs.set_rolled_back(row["id"], notice)
            log.warning("run %s reloaded from %s after the trainer restart: %s", row["id"], path, notice,
                        extra={"event": "run_rolled_back", "model_id": row["id"], "checkpoint": path})

    def _rollback_notice(self, model_id: str, path: str, saved_step: int | None) -> str:
        last = self.core.last_step.get(model_id)
        if saved_step is None or last is None:
            lost = "the optimizer steps and accumulated gradients after it were lost"
        else:
            lost = (f"{last - saved_step} optimizer step(s) after it were lost (it was saved at step {saved_step}; "
                    f"the run had reached step {last}), and any gradients accumulated since the last step")
        self.core.last_step[model_id] = saved_step or 0
        return (f"the trainer crashed and restarted, and run {model_id} was rolled back to its checkpoint {path}: "
                f"{lost}. It trains on from that checkpoint; repeat the lost steps if you need them")

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    async def _save(self, owner: str, row: dict, kind: str, name: str, write: Callable[[str, str], Awaitable[None]],
                    overwrite: bool, ttl_seconds: int | None, user_metadata: dict | None,
                    finish: Callable[[Path], None] | None = None) -> str:
        """Have the trainer write a checkpoint into staging (``write(model_id, directory)``: one of its save calls),
        ``finish`` it there (if given), then publish and record it."""
        model_id = row["id"]
        path = tinker_path(model_id, kind, name)
        if self.records.checkpoints.live_checkpoint(path) is not None and not overwrite:
            raise UserError(f"checkpoint {path} already exists; choose another name")
        expires = self.checkpoints.expiry(ttl_seconds)
        staging, uid = self.checkpoints.staging(path), self.checkpoints.new_uid()
        try:
            with disk_full_names(path):
                await write(model_id, str(staging))
                if finish is not None:
                    await asyncio.to_thread(finish, staging)
                size = await asyncio.to_thread(self.checkpoints.publish, staging, path, uid)
        finally:
            self.checkpoints.discard(staging)
        replaced = self.records.checkpoints.add_checkpoint(
            path, uid=uid, training_run_id=model_id, checkpoint_id=parse_path(path).checkpoint_id, kind=kind,
            owner=owner, base_model=row["base_model"], size_bytes=size, expires_at=expires, user_metadata=user_metadata)
        if replaced is not None:  # overwritten, or expired and not yet swept: its files go now
            self.checkpoints.delete(path, replaced["uid"])
        log.info("checkpoint saved: %s (%d bytes)", path, size,
                 extra={"event": "checkpoint_saved", "model_id": model_id, "path": path, "bytes": size})
        return path

    def save_weights(self, owner: str, req: types.SaveWeightsRequest, idem: str | None) -> dict:
        async def job(row: dict) -> Payload:
            name = req.path or f"seq-{req.seq_id or 0:06d}"
            path = await self._save(owner, row, "training", name, self._trainer(row).save_state, req.overwrite,
                                    req.ttl_seconds, req.user_metadata)
            return json_payload(types.SaveWeightsResponse(path=path, type="save_weights"))

        return self.core.ordered(owner, "save_weights", req.model_id, req.seq_id, idem, job)

    def save_weights_for_sampler(self, owner: str, req: types.SaveWeightsForSamplerRequest, idem: str | None) -> dict:
        async def job(row: dict) -> Payload | Finishing:
            if req.path is None:
                return await self._save_unnamed_for_sampler(owner, row, req)
            if not self.sampling.ephemeral.may_hold(row["id"]):  # the trainer writes the files in the save's turn
                path = await self._save(owner, row, "sampler", req.path, self._trainer(row).save_for_sampler, False,
                                        req.ttl_seconds, req.user_metadata)
                return json_payload(types.SaveWeightsForSamplerResponse(path=path, type="save_weights_for_sampler"))
            return await self._save_named_for_sampler(owner, row, req)

        return self.core.ordered(owner, "save_weights_for_sampler", req.model_id, req.seq_id, idem, job)

    async def _save_named_for_sampler(self, owner: str, row: dict, req: types.SaveWeightsForSamplerRequest) -> Finishing:
        """A named sampler save off the run's order: in its turn the trainer hands the weights over in memory (Ray's
        object store, as for an unnamed save), and the run's next requests go on at once; the files are written from
        that copy after the turn, and the future resolves only once they are durable and recorded (a crash before
        then loses nothing that was acknowledged). One such write per run at a time: a run's next named save waits
        for the last one's files, so their memory never piles up; a run whose weights are more than
        ``--ephemeral-memory-mb`` has its files written by the trainer in the turn instead (``may_hold``)."""
        model_id = row["id"]
        path = tinker_path(model_id, "sampler", req.path)
        if self.records.checkpoints.live_checkpoint(path) is not None or path in self._naming:
            raise UserError(f"checkpoint {path} already exists; choose another name")
        self._naming.add(path)  # taken from now on, for a save of the same name sent meanwhile (or without a seq_id)
        try:
            if (previous := self._writing.get(model_id)) is not None:
                await asyncio.wait([previous])
            nbytes, held = await self._trainer(row).sampler_tensors(model_id, True)
        except BaseException:
            self._naming.discard(path)
            raise
        self.sampling.ephemeral.sized(model_id, nbytes)

        async def write(_model_id: str, directory: str) -> None:
            weights = await asyncio.to_thread(fetched, held)  # on this node: read in place from the object store
            with writing(Path(directory)):
                Path(directory).mkdir(parents=True, exist_ok=True)
                await asyncio.to_thread(weights.write, Path(directory))

        async def finish() -> Payload:
            try:
                saved = await self._save(owner, row, "sampler", req.path, write, False, req.ttl_seconds,
                                         req.user_metadata)
            finally:
                self._naming.discard(path)
            return json_payload(types.SaveWeightsForSamplerResponse(path=saved, type="save_weights_for_sampler"))

        task = self._writing[model_id] = asyncio.ensure_future(finish())
        task.add_done_callback(lambda done: self._writing.pop(model_id, None) if self._writing.get(model_id) is done
                               else None)
        return Finishing(task)

    def save_weights_external(self, owner: str, req: types.SaveWeightsExternalRequest, idem: str | None) -> dict:
        """The adapter under ``external_weights/``, for download with ``get_external_weights_urls``, its tensors
        named as hosted Tinker names exports (``adapters.lora.files``), with the samplers' copy beside them
        (``CheckpointStore.sampler_copy``) — or, given ``age_encryption_recipients``, every file encrypted to them as
        ``<name>.age`` before it is published, and no copy (the server keeps nothing readable of it)."""
        async def job(row: dict) -> Payload:
            trainer = self._trainer(row)
            if req.age_encryption_recipients is not None:
                write = trainer.save_for_export
                encrypt = partial(encrypt_directory, recipients=parse_recipients(req.age_encryption_recipients))
            else:
                async def write(model_id: str, directory: str) -> None:  # and the samplers' copy: sampleable too
                    await trainer.save_for_export(model_id, directory)
                    await trainer.save_for_sampler(model_id, str(self.checkpoints.sampler_copy(Path(directory))))
                encrypt = None
            path = await self._save(owner, row, "external", req.path, write, False, req.ttl_seconds, None, encrypt)
            return json_payload(types.SaveWeightsExternalResponseInternal(path=path, type="save_weights_external"))

        return self.core.ordered(owner, "save_weights_external", req.model_id, req.seq_id, idem, job)

    async def _save_unnamed_for_sampler(self, owner: str, row: dict, req: types.SaveWeightsForSamplerRequest) -> Payload:
        """``save_weights_and_get_sampling_client``: weights saved outside the checkpoint listing, and a sampling
        session over them that can sample at once. The weights go to the samplers in memory, in the form they load,
        nothing written, unless they are more than memory allows (``compat_server.sampling.ephemeral``)."""
        ephemeral = self.sampling.ephemeral
        if ephemeral.may_hold(row["id"]):
            # The weights stay in Ray's object store where the trainer put them, owned by this process (they
            # outlive the trainer); each sampler replica fetches them from there (``adapters.boundary.by_reference``).
            peft = self.sampling.samplers.takes_peft_tensors(row["base_model"])
            nbytes, held = await self._trainer(row).sampler_tensors(row["id"], peft)
            ephemeral.sized(row["id"], nbytes)
            if ephemeral.fits(nbytes):
                sampler_id = self.sampling.sessions.register_ephemeral(
                    owner, row, req.sampling_session_seq_id, req.kind, tensors=held, nbytes=nbytes)
                return json_payload(types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id,
                                                                                type="save_weights_for_sampler"))
            del held  # not kept while the files are written
            log.info("sampler weights of %s (%d MiB) are more than --ephemeral-memory-mb %d: this run's unnamed saves "
                     "are written under the data directory", row["id"], nbytes // 2**20, ephemeral.memory_bytes // 2**20)
        directory = ephemeral.directory(row["id"])
        staging = directory.with_name(f".staging-{directory.name}")
        try:
            with disk_full_names(f"sampler weights of {row['id']}"):
                await self._trainer(row).save_for_sampler(row["id"], str(staging))
            staging.rename(directory)
        finally:
            self.checkpoints.discard(staging)
        sampler_id = self.sampling.sessions.register_ephemeral(owner, row, req.sampling_session_seq_id, req.kind, directory)
        return json_payload(types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id,
                                                                        type="save_weights_for_sampler"))

    def load_weights(self, owner: str, req: types.LoadWeightsRequest, idem: str | None) -> dict:
        """Load a checkpoint into an existing model (``load_state``) or into a new one (``create_training_client_
        from_state``, which names the model by session and client number and sends no create_model)."""
        if req.model_id is None:
            if req.session_id is None or req.model_seq_id is None:
                return self.core.future(self.scheduler.fail_now(
                    owner=owner, kind="load_weights", idempotency_key=idem,
                    message="load_weights needs model_id, or session_id and model_seq_id"))
            return self._load_into_new_model(owner, req, idem)
        if req.seq_id is not None and req.seq_id > 1:
            return self.core.ordered(owner, "load_weights", req.model_id, req.seq_id, idem, _load_refused(req.seq_id))

        async def job(row: dict) -> Payload:
            ckpt = self._readable_checkpoint(owner, req.path)
            if ckpt["base_model"] != row["base_model"]:
                raise UserError(f"checkpoint {req.path} was trained on {ckpt['base_model']}, "
                                f"but model {req.model_id} uses {row['base_model']}")
            spec = await self._load(row["base_model"], req.model_id, req.path, ckpt["uid"], req.optimizer)
            self.records.runs.set_model_lora(req.model_id, asdict(spec))
            return json_payload(types.LoadWeightsResponse(path=req.path, model_id=req.model_id, type="load_weights"))

        return self.core.ordered(owner, "load_weights", req.model_id, req.seq_id, idem, job)

    def _load_into_new_model(self, owner: str, req: types.LoadWeightsRequest, idem: str | None) -> dict:
        model_id = model_id_for(req.session_id, req.model_seq_id)

        async def job() -> Payload:
            if self.records.sessions.session(req.session_id, owner) is None:
                raise NotFound(f"unknown session_id {req.session_id!r}")
            if self.records.runs.model(model_id, owner) is not None:
                raise UserError(f"model {model_id} already exists")
            ckpt = self._readable_checkpoint(owner, req.path)
            if req.base_model and req.base_model != ckpt["base_model"]:
                raise UserError(f"checkpoint {req.path} was trained on {ckpt['base_model']}, not {req.base_model}")
            base = self.core.base(ckpt["base_model"])
            with self.core.new_model_slot(owner):
                spec: LoraSpec = await self._load(base.name, model_id, req.path, ckpt["uid"], req.optimizer)
                self.records.runs.create_model(model_id, session_id=req.session_id, owner=owner, base_model=base.name,
                                               lora=asdict(spec), user_metadata=req.user_metadata)
            log.info("model created from %s: %s on %s", req.path, model_id, base.name,
                     extra={"event": "model_created", "model_id": model_id, "base_model": base.name,
                            "from_checkpoint": req.path})
            return json_payload(types.LoadWeightsResponse(path=req.path, model_id=model_id, type="load_weights"))

        return self.core.future(self.scheduler.submit(owner=owner, kind="load_weights", job=job,
                                                      idempotency_key=idem), model_id)

    def _trainer(self, row: dict) -> Trainer:
        return self.scheduler.trainer_for(row["base_model"])

    def _readable_checkpoint(self, owner: str, path: str) -> dict:
        return self.checkpoints.readable(self.records, owner, path)[0]

    async def _load(self, base_model: str, model_id: str, path: str, uid: str, with_optimizer: bool) -> LoraSpec:
        """Load save ``uid`` of ``path`` (checked by the caller just before): its own directory, so a save made
        meanwhile under the same name is never what gets loaded."""
        directory = self.checkpoints.directory(path, uid)
        if not directory.exists():
            raise NotFound(f"checkpoint {path} not found (deleted while the request waited)")
        spec = read_lora_spec(directory)
        await self.scheduler.trainer_for(base_model).load_state(model_id, str(directory), with_optimizer)
        log.info("weights loaded: %s ← %s (%s optimizer state)", model_id, path, "with" if with_optimizer else "without")
        return spec


def _load_refused(seq_id: int):
    """The job of a ``load_state`` that is not its client's first request: refused as hosted Tinker refuses it
    (400, "LoadWeights is not permitted with seq_id N"), in its turn, so the run's later requests go on."""
    async def job(_: dict) -> Payload:
        raise UserError(f"LoadWeights is not permitted with seq_id {seq_id}: as on hosted Tinker, a checkpoint loads "
                        "only as a training client's first request; load it into a new client instead "
                        "(ServiceClient.create_training_client_from_state, or …_with_optimizer)")
    return job
