"""What the SDK's ``RestClient`` manages: training runs and their checkpoints (list, delete, publish). Its
sessions are in ``compat_server.sessions``.

A tenant sees its own objects; another tenant's unpublished objects answer exactly like missing ones (404), so their
existence is never revealed. Published checkpoints are readable by every tenant but changed only by their owner.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from litestar.exceptions import PermissionDeniedException
from tinker import types

from adapters.trainer.interface import read_lora_spec
from compat_server.records import Records
from compat_server.runs.checkpoint_store import CheckpointStore, parse_path, tinker_path
from compat_server.runs.downloads import DownloadGrant, UrlSigner
from compat_server.training.core import model_id_for
from contract import documented
from shims.errors import NotFound, UserError

log = logging.getLogger("compat_server.runs")

MAX_PAGE = 1000


def checked_page(limit: int, offset: int) -> tuple[int, int]:
    """A page's bounds, or a user error naming them."""
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise UserError(f"limit must be between 1 and {MAX_PAGE} and offset ≥ 0, got limit={limit} offset={offset}")
    return limit, offset


def string_metadata(text: str | None) -> dict[str, str]:
    """Stored user metadata as the SDK's response types take it (string values): ``create_session`` and
    ``create_model`` accept any JSON values, so a non-string one is answered, and searched, as its JSON text."""
    metadata = json.loads(text or "{}")
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in metadata.items()}


def checkpoint_of(row: dict) -> documented.Checkpoint:
    """A checkpoint as the REST routes answer it: the SDK's type with SDK 0.39's ``base_model``."""
    return documented.Checkpoint(
        checkpoint_id=row["checkpoint_id"], checkpoint_type=row["kind"], time=row["created"],
        tinker_path=row["tinker_path"], size_bytes=row["size_bytes"], public=bool(row["public"]),
        user_metadata=json.loads(row["user_metadata"] or "{}") or None, expires_at=row["expires_at"],
        base_model=row["base_model"])


class RunsService:
    def __init__(self, records: Records, checkpoints: CheckpointStore, signer: UrlSigner) -> None:
        self.records = records
        self.checkpoints = checkpoints
        self.signer = signer

    def _run(self, owner: str, training_run_id: str) -> dict:
        row = self.records.runs.model(training_run_id, owner)
        if row is None:
            raise NotFound(f"training run {training_run_id!r} not found")
        return row

    def _training_run(self, row: dict) -> documented.TrainingRun:
        checkpoints = self.records.checkpoints.run_checkpoints(row["id"])
        last = {kind: next((checkpoint_of(c) for c in reversed(checkpoints) if c["kind"] == kind), None)
                for kind in ("training", "sampler")}
        return documented.TrainingRun(
            training_run_id=row["id"], base_model=row["base_model"], model_owner=row["owner"][:16],
            is_lora=bool(row["is_lora"]), corrupted=False, lora_rank=row["lora_rank"],
            last_request_time=row["last_request"], last_checkpoint=last["training"],
            last_sampler_checkpoint=last["sampler"], user_metadata=string_metadata(row["user_metadata"]) or None)

    def get_training_run(self, owner: str, training_run_id: str) -> documented.TrainingRun:
        return self._training_run(self._run(owner, training_run_id))

    def list_training_runs(self, owner: str, limit: int, offset: int) -> documented.TrainingRunsResponse:
        limit, offset = checked_page(limit, offset)
        rows, total = self.records.runs.models_page(owner, limit, offset)
        return documented.TrainingRunsResponse(training_runs=[self._training_run(r) for r in rows],
                                          cursor=types.Cursor(offset=offset, limit=limit, total_count=total))

    def list_checkpoints(self, owner: str, training_run_id: str) -> documented.CheckpointsListResponse:
        self._run(owner, training_run_id)
        rows = self.records.checkpoints.run_checkpoints(training_run_id)
        return documented.CheckpointsListResponse(checkpoints=[checkpoint_of(r) for r in rows])

    def list_user_checkpoints(self, owner: str, limit: int, offset: int) -> documented.CheckpointsListResponse:
        limit, offset = checked_page(limit, offset)
        rows, total = self.records.checkpoints.user_checkpoints(owner, limit, offset)
        return documented.CheckpointsListResponse(checkpoints=[checkpoint_of(r) for r in rows],
                                                  cursor=types.Cursor(offset=offset, limit=limit, total_count=total))

    def _owned_checkpoint(self, owner: str, training_run_id: str, checkpoint_id: str) -> dict:
        path = f"tinker://{training_run_id}/{checkpoint_id}"
        parse_path(path)
        row = self.records.checkpoints.checkpoint(path, owner)
        if row is None or row["owner"] != owner:  # a published checkpoint of another tenant is read-only
            raise NotFound(f"checkpoint {path} not found")
        return row

    def delete_checkpoint(self, owner: str, training_run_id: str, checkpoint_id: str) -> None:
        row = self._owned_checkpoint(owner, training_run_id, checkpoint_id)
        path = row["tinker_path"]
        self.records.checkpoints.delete_checkpoint(path, row["uid"])
        self.checkpoints.delete(path, row["uid"])
        self.records.account.audit(owner, "checkpoint_delete", model_id=training_run_id, tinker_path=path)
        log.info("checkpoint deleted: %s", path)

    def set_public(self, owner: str, training_run_id: str, checkpoint_id: str, public: bool) -> None:
        path = self._owned_checkpoint(owner, training_run_id, checkpoint_id)["tinker_path"]
        self.records.checkpoints.set_checkpoint_public(path, public)
        self.records.account.audit(owner, "checkpoint_publish" if public else "checkpoint_unpublish",
                                   model_id=training_run_id, tinker_path=path)
        log.info("checkpoint %s: %s", "published" if public else "unpublished", path)

    def set_ttl(self, owner: str, training_run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        path = self._owned_checkpoint(owner, training_run_id, checkpoint_id)["tinker_path"]
        self.records.checkpoints.set_checkpoint_expiry(path, self.checkpoints.expiry(ttl_seconds))
        self.records.account.audit(owner, "checkpoint_ttl_set", model_id=training_run_id, tinker_path=path,
                                   ttl_seconds=ttl_seconds)
        log.info("checkpoint %s expires %s", path, f"in {ttl_seconds} s" if ttl_seconds is not None else "never")

    def weights_info(self, owner: str, tinker_path: str) -> types.WeightsInfoResponse:
        """What loading a checkpoint needs to know: base model and LoRA layout."""
        row, directory = self.checkpoints.readable(self.records, owner, tinker_path)
        spec = read_lora_spec(directory)
        return types.WeightsInfoResponse(base_model=row["base_model"], is_lora=True, lora_rank=spec.rank,
                                         train_unembed=spec.train_unembed, train_mlp=spec.train_mlp,
                                         train_attn=spec.train_attn)

    def download_urls(self, owner: str, tinker_path: str, base_url: str) -> types.ExternalWeightsUrlsResponse:
        """One signed URL per file of the checkpoint, for plain-HTTP download until they expire. A URL names this
        save (its uid) and the key it was given to, so it stops working when that key may no longer read it."""
        row, directory = self.checkpoints.readable(self.records, owner, tinker_path)
        self.records.account.audit(owner, "checkpoint_read", model_id=row["training_run_id"], tinker_path=tinker_path,
                                   purpose="download (external_weights_urls)", owned=row["owner"] == owner)
        grant = DownloadGrant(tinker_path=tinker_path, uid=row["uid"], grantee=self.signer.grantee(owner))
        urls, expires = {}, 0
        parsed = parse_path(tinker_path)
        for file in self.checkpoints.files(directory):
            expires, query = self.signer.sign(grant, file)
            urls[file] = (f"{base_url.rstrip('/')}/api/v1/download/{parsed.training_run_id}/{parsed.checkpoint_id}/"
                          f"{quote(file)}?{query}")
        return types.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, UTC))

    def download_file(self, grant: DownloadGrant, file: str, expires: int, signature: str) -> Path:
        """The file a signed URL names, if the URL is intact and unexpired and — checked now, not when it was
        signed — its save still exists, unexpired, and may be read by the key it was given to (published, or
        that key's own)."""
        if not self.signer.valid(grant, file, expires, signature):
            raise PermissionDeniedException("this download URL is invalid or has expired; ask for new URLs")
        row = self.records.checkpoints.live_checkpoint(grant.tinker_path)
        if row is None or row["uid"] != grant.uid:
            raise NotFound(f"{grant.tinker_path} no longer exists as it was when this URL was made")
        if not row["public"] and self.signer.grantee(row["owner"]) != grant.grantee:
            raise PermissionDeniedException(f"{grant.tinker_path} is no longer published; its owner can ask for new "
                                            "URLs")
        directory = self.checkpoints.directory(grant.tinker_path, grant.uid)
        target = (directory / file).resolve()
        if not target.is_file() or directory.resolve() not in target.parents or file not in \
                self.checkpoints.files(directory):
            raise NotFound(f"{file} of {grant.tinker_path} no longer exists")
        return target

    def copy_weights(self, owner: str, req: types.CopyWeightsRequest) -> types.CopyWeightsResponse:
        """A copy of a readable checkpoint (its own, or a published one) owned by the caller, in a new training run
        that lists like any other but cannot be trained. Files are hard links: no bytes are duplicated, and deleting
        either side leaves the other intact."""
        row, directory = self.checkpoints.readable(self.records, owner, req.source_path)
        if req.weights_access_token:
            raise UserError("weights_access_token is not supported by this server; have the owner publish the "
                            "checkpoint instead")
        if req.session_id is not None:
            if req.model_seq_id is None:
                raise UserError("copy_weights with a session_id needs model_seq_id too")
            if self.records.sessions.session(req.session_id, owner) is None:
                raise NotFound(f"session {req.session_id!r} not found")
            run_id = model_id_for(req.session_id, req.model_seq_id)
            if self.records.runs.model(run_id, owner) is not None:
                raise UserError(f"training run {run_id} already exists")
        elif req.destination_project_id:
            run_id = f"copy-{uuid.uuid4().hex[:16]}"
        else:
            raise UserError("copy_weights needs a destination_project_id, or a session_id and model_seq_id")
        source = parse_path(req.source_path)
        path = tinker_path(run_id, source.checkpoint_type, source.checkpoint_id.split("/", 1)[1])
        expires = self.checkpoints.expiry(req.ttl_seconds)
        staging, uid = self.checkpoints.staging(path), self.checkpoints.new_uid()
        try:
            shutil.copytree(directory, staging, copy_function=os.link)
            size = self.checkpoints.publish(staging, path, uid)
        finally:
            self.checkpoints.discard(staging)
        self.records.runs.create_model(run_id, session_id=req.session_id or "", owner=owner,
                                       base_model=row["base_model"], lora=asdict(read_lora_spec(directory)),
                                       user_metadata={"copied_from": req.source_path},
                                       project_id=req.destination_project_id if req.session_id is None else None)
        self.records.runs.set_model_status(run_id, "a read-only copy")
        self.records.checkpoints.add_checkpoint(path, uid=uid, training_run_id=run_id,
                                                checkpoint_id=source.checkpoint_id, kind=source.checkpoint_type,
                                                owner=owner, base_model=row["base_model"], size_bytes=size,
                                                expires_at=expires, user_metadata=None)
        self.records.account.audit(owner, "checkpoint_copy", model_id=run_id, tinker_path=path,
                                   source_path=req.source_path)
        log.info("checkpoint copied: %s → %s", req.source_path, path)
        return types.CopyWeightsResponse(tinker_path=path)

    def sweep_expired(self) -> int:
        """Delete every expired checkpoint from the records and the disk; returns how many."""
        expired = self.records.checkpoints.expired_checkpoints()
        for path, uid in expired:
            # not if saved again under the same name meanwhile
            if self.records.checkpoints.delete_checkpoint(path, uid):
                self.checkpoints.delete(path, uid)
                log.info("checkpoint expired and deleted: %s", path)
        return len(expired)
