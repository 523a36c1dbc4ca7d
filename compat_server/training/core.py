"""What every training operation shares: model lookups at the moment a job runs, per-model ``seq_id`` ordering
through the scheduler, the per-key limit on loaded runs, and each run's step (what a rollback lost).

One ``TrainingCore`` is held by both ``TrainingService`` and its ``CheckpointCalls``, so the two see the same runs
being created and the same steps, without either inheriting the other's operations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tinker import types

from adapters.models.resolve import BaseModelSpec
from compat_server.jobs.futures import JSON, Payload
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import Records
from shims.errors import NotFound, UserError


def json_payload(model: types.BaseModel) -> Payload:
    return Payload(JSON, model.model_dump_json(exclude_none=True).encode())


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id format the SDK itself assumes when it creates a training client from saved state."""
    return f"{session_id}:train:{model_seq_id}"


class RolledBack(RuntimeError):
    """The run was rolled back to a checkpoint after a trainer crash: its owner's first request after that fails
    with this, saying from where and what was lost, so that no training silently repeats or skips steps."""


class TrainingCore:
    """The runs' lookups, ordering and limits that the training operations share."""

    def __init__(self, records: Records, scheduler: Scheduler, base_models: dict[str, BaseModelSpec],
                 max_adapters_per_key: int | None) -> None:
        self.records = records
        self.scheduler = scheduler
        self.base_models = base_models
        self.max_adapters_per_key = max_adapters_per_key
        self._creating: dict[str, int] = {}
        self.last_step: dict[str, int] = {}
        """Each run's optimizer step, to say how many a rollback lost."""

    def future(self, request_id: str, model_id: str | None = None) -> dict:
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def owned_model(self, owner: str, model_id: str) -> dict:
        row = self.records.runs.model(model_id, owner)
        if row is None:
            raise NotFound(f"unknown model_id {model_id!r}")
        if row["status"] != "active":
            raise UserError(f"model {model_id} is {row['status']}; create a new training client")
        return row

    def ordered_row(self, owner: str, model_id: str) -> dict:
        """The run for a request in its turn: owned and active, and — once after a rollback — ``RolledBack``."""
        row = self.owned_model(owner, model_id)
        notice = self.records.runs.take_rollback_notice(model_id) if row["rollback_unseen"] else None
        if notice is not None:
            raise RolledBack(notice)
        return row

    @contextmanager
    def new_model_slot(self, owner: str) -> Iterator[None]:
        """Admit one more loaded model for ``owner`` under ``--max-adapters-per-key``. Creations still running count
        too, so concurrent creates cannot slip past the limit together."""
        creating = self._creating.get(owner, 0)
        loaded = self.records.runs.active_model_count(owner) + creating
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

    def base(self, name: str) -> BaseModelSpec:
        spec = self.base_models.get(name)
        if spec is None:
            raise UserError(f"unknown base model {name!r}; this server serves: {', '.join(self.base_models)}")
        return spec

    def ordered(self, owner: str, kind: str, model_id: str, seq_id: int | None, idem: str | None, job) -> dict:
        """Queue ``job(model_row)`` in the model's seq order; an unknown model fails the future as a user error."""
        try:
            self.owned_model(owner, model_id)
        except UserError as exc:
            return self.future(self.scheduler.fail_now(owner=owner, kind=kind, message=str(exc),
                                                       idempotency_key=idem), model_id)

        async def run() -> Payload:
            return await job(self.ordered_row(owner, model_id))  # re-read: it may have been unloaded meanwhile

        request_id = self.scheduler.submit(owner=owner, kind=kind, job=run, model_id=model_id, seq_id=seq_id,
                                           idempotency_key=idem)
        return self.future(request_id, model_id)
