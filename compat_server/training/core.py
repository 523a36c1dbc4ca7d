"""What every training operation shares: the service's state, model lookups at the moment a job runs, per-model
``seq_id`` ordering through the scheduler, and the per-key limit on loaded runs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from tinker import types

from adapters.models.resolve import BaseModelSpec
from adapters.trainer.interface import MAX_LORA_RANK
from compat_server.jobs.futures import JSON, Payload
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import Records
from compat_server.runs.checkpoint_store import CheckpointStore
from compat_server.sampling.service import SamplingService
from compat_server.training.custom_losses import CustomLossStore
from shims.errors import NotFound, UserError

log = logging.getLogger("compat_server.training")


def json_payload(model: types.BaseModel) -> Payload:
    return Payload(JSON, model.model_dump_json(exclude_none=True).encode())


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id format the SDK itself assumes when it creates a training client from saved state."""
    return f"{session_id}:train:{model_seq_id}"


class RolledBack(RuntimeError):
    """The run was rolled back to a checkpoint after a trainer crash: its owner's first request after that fails
    with this, saying from where and what was lost, so that no training silently repeats or skips steps."""


class TrainingCore:
    """The state and helpers of ``TrainingService`` (which adds the operations)."""

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
        self.custom_losses = CustomLossStore()

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
        notice = self.records.take_rollback_notice(model_id) if row["rollback_unseen"] else None
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
        """End sessions that stopped heartbeating ``timeout_seconds`` ago. Returns how many sessions ended."""
        cutoff = (datetime.now(UTC) - timedelta(seconds=timeout_seconds)).isoformat()
        stale = self.records.stale_sessions(cutoff)
        for session in stale:
            unloaded = await self.end_session(session["id"], "expired", "its session expired")
            log.info("session expired: %s (no heartbeat since %s); models unloaded: %s", session["id"],
                     session["last_heartbeat"], ", ".join(unloaded) or "none")
        return len(stale)

    async def end_session(self, session_id: str, reason: str, why: str) -> list[str]:
        """A session ends (its client closed it, or it expired): its training runs leave the trainer, so their
        adapter slots (``--max-adapters``, ``--max-adapters-per-key``) are free again, and its custom losses go;
        its saved checkpoints stay (load one into a new training client to continue). Returns the runs unloaded."""
        models = self.records.active_models_of(session_id)
        for row in models:
            try:
                await self.scheduler.trainer(row["base_model"], "unload", row["id"])
            except Exception as exc:  # noqa: BLE001 - the model is gone from the trainer either way
                log.warning("unloading %s of ended session %s: %s", row["id"], session_id, exc)
            self.records.set_model_status(row["id"], f"unloaded ({why}; load a checkpoint of it into a new "
                                                     "training client to continue)")
        self.records.finish_session(session_id, reason)
        self.custom_losses.drop_session(session_id)
        return [row["id"] for row in models]

