"""What the SDK's ``RestClient`` manages: training runs, their checkpoints (list, delete, publish) and sessions.

A tenant sees its own objects; another tenant's unpublished objects answer exactly like missing ones (404), so their
existence is never revealed. Published checkpoints are readable by every tenant but changed only by their owner.
"""

from __future__ import annotations

import json
import logging

from tinker import types

from compat_server.checkpoints import CheckpointStore, parse_path
from compat_server.records import Records
from shims.errors import NotFound, UserError

log = logging.getLogger("compat_server.runs")

MAX_PAGE = 1000


def _page(limit: int, offset: int) -> tuple[int, int]:
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise UserError(f"limit must be between 1 and {MAX_PAGE} and offset ≥ 0, got limit={limit} offset={offset}")
    return limit, offset


def checkpoint_of(row: dict) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=row["checkpoint_id"], checkpoint_type=row["kind"], time=row["created"],
        tinker_path=row["tinker_path"], size_bytes=row["size_bytes"], public=bool(row["public"]),
        user_metadata=json.loads(row["user_metadata"] or "{}") or None, expires_at=row["expires_at"])


class RunsService:
    def __init__(self, records: Records, checkpoints: CheckpointStore) -> None:
        self.records = records
        self.checkpoints = checkpoints

    def _run(self, owner: str, training_run_id: str) -> dict:
        row = self.records.model(training_run_id, owner)
        if row is None:
            raise NotFound(f"training run {training_run_id!r} not found")
        return row

    def _training_run(self, row: dict) -> types.TrainingRun:
        checkpoints = self.records.run_checkpoints(row["id"])
        last = {kind: next((checkpoint_of(c) for c in reversed(checkpoints) if c["kind"] == kind), None)
                for kind in ("training", "sampler")}
        return types.TrainingRun(
            training_run_id=row["id"], base_model=row["base_model"], model_owner=row["owner"][:16],
            is_lora=bool(row["is_lora"]), corrupted=False, lora_rank=row["lora_rank"],
            last_request_time=row["last_request"], last_checkpoint=last["training"],
            last_sampler_checkpoint=last["sampler"], user_metadata=json.loads(row["user_metadata"] or "{}") or None)

    def get_training_run(self, owner: str, training_run_id: str) -> types.TrainingRun:
        return self._training_run(self._run(owner, training_run_id))

    def list_training_runs(self, owner: str, limit: int, offset: int) -> types.TrainingRunsResponse:
        limit, offset = _page(limit, offset)
        rows, total = self.records.models_page(owner, limit, offset)
        return types.TrainingRunsResponse(training_runs=[self._training_run(r) for r in rows],
                                          cursor=types.Cursor(offset=offset, limit=limit, total_count=total))

    def list_checkpoints(self, owner: str, training_run_id: str) -> types.CheckpointsListResponse:
        self._run(owner, training_run_id)
        rows = self.records.run_checkpoints(training_run_id)
        return types.CheckpointsListResponse(checkpoints=[checkpoint_of(r) for r in rows])

    def list_user_checkpoints(self, owner: str, limit: int, offset: int) -> types.CheckpointsListResponse:
        limit, offset = _page(limit, offset)
        rows, total = self.records.user_checkpoints(owner, limit, offset)
        return types.CheckpointsListResponse(checkpoints=[checkpoint_of(r) for r in rows],
                                             cursor=types.Cursor(offset=offset, limit=limit, total_count=total))

    def _owned_checkpoint(self, owner: str, training_run_id: str, checkpoint_id: str) -> str:
        path = f"tinker://{training_run_id}/{checkpoint_id}"
        parse_path(path)
        row = self.records.checkpoint(path, owner)
        if row is None or row["owner"] != owner:  # a published checkpoint of another tenant is read-only
            raise NotFound(f"checkpoint {path} not found")
        return path

    def delete_checkpoint(self, owner: str, training_run_id: str, checkpoint_id: str) -> None:
        path = self._owned_checkpoint(owner, training_run_id, checkpoint_id)
        self.records.delete_checkpoint(path)
        self.checkpoints.delete(path)
        log.info("checkpoint deleted: %s", path)

    def set_public(self, owner: str, training_run_id: str, checkpoint_id: str, public: bool) -> None:
        path = self._owned_checkpoint(owner, training_run_id, checkpoint_id)
        self.records.set_checkpoint_public(path, public)
        log.info("checkpoint %s: %s", "published" if public else "unpublished", path)

    def list_sessions(self, owner: str, limit: int, offset: int) -> types.ListSessionsResponse:
        limit, offset = _page(limit, offset)
        return types.ListSessionsResponse(sessions=self.records.sessions_page(owner, limit, offset))

    def get_session(self, owner: str, session_id: str) -> types.GetSessionResponse:
        row = self.records.session(session_id, owner)
        if row is None:
            raise NotFound(f"session {session_id!r} not found")
        runs, samplers = self.records.session_children(session_id)
        return types.GetSessionResponse(training_run_ids=runs, sampler_ids=samplers,
                                        user_metadata=json.loads(row["user_metadata"] or "{}") or None)
