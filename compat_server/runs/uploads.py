"""Adapter uploads (SDK 0.39's ``external_weights_upload_start`` → PUT each file → ``…_finish``): a LoRA adapter
made elsewhere — exported from hosted Tinker or another server, or saved by the ``peft`` library — becomes an
``external_weights`` checkpoint of this server, which training clients load, samplers sample and the OpenAI routes
serve like any other.

Every step checks before it stores: ``start`` the base model, the LoRA config and the key's open uploads; each PUT
its signed URL (this upload, this file, the key that started it, unexpired), that the URL was not used before, and
the file's size against the most an adapter of that model and rank can hold — announced, then as it streams — before
a byte is kept; ``finish`` that every file came, then the trainer reads the adapter as the model's own LoRA (shapes,
dtypes, finite values, one scale, only the weight groups the config names) before the checkpoint exists. An upload
that fails its check is deleted whole; nothing of it is listed or kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from litestar.exceptions import ClientException, HTTPException, PermissionDeniedException

from adapters.disk import DiskFull, writing
from adapters.lora.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from adapters.models.resolve import BaseModelSpec
from adapters.trainer.interface import LoraSpec
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import Records
from compat_server.records.uploads import FINISHED, OPEN, RECEIVED
from compat_server.runs.checkpoint_store import CheckpointStore, parse_path, tinker_path
from compat_server.runs.downloads import UrlSigner
from compat_server.runs.options import UploadOptions
from contract import documented
from shims.errors import NotFound, UserError

log = logging.getLogger("compat_server.runs")

FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)
"""What ``save_weights_external`` writes (unencrypted), so what an upload takes."""
CONFIG_BYTES = 1 << 20
"""The most an ``adapter_config.json`` may hold."""
HEADER_BYTES_PER_TENSOR = 512
"""Room for one tensor's entry in a safetensors header (its name, dtype, shape and offsets)."""
WRITE_CHUNK = 4 << 20
"""Bytes a PUT gathers before writing them, off the event loop."""
CHECKPOINT_NAME = "uploaded"
PROJECT_CHARS = 256


class UploadService:
    def __init__(self, records: Records, checkpoints: CheckpointStore, signer: UrlSigner, scheduler: Scheduler,
                 base_models: dict[str, BaseModelSpec], options: UploadOptions, root: Path,
                 max_lora_rank: int, registered_keys: bool) -> None:
        """``root``: where files of open uploads wait, on the checkpoints' filesystem (they are linked into the
        checkpoint when it is made); ``registered_keys``: the server takes only registered keys (``--auth keys``),
        so a PUT is refused once the key that started its upload is revoked."""
        self.records = records
        self.checkpoints = checkpoints
        self.signer = signer
        self.scheduler = scheduler
        self.base_models = base_models
        self.options = options
        self.root = root
        self.max_lora_rank = max_lora_rank
        self.registered_keys = registered_keys
        root.mkdir(parents=True, exist_ok=True)
        if interrupted := records.uploads.interrupted():
            log.warning("%d adapter upload steps were left midway by the previous server process; they can be "
                        "repeated", interrupted)
        known = set(records.uploads.all_uploads())
        for directory in root.iterdir():  # left by a process that died before it recorded or deleted the upload
            if directory.name not in known:
                shutil.rmtree(directory, ignore_errors=True)

    # ---- start ------------------------------------------------------------------------------------------------------
    def start(self, owner: str, req: documented.ExternalWeightsUploadStartRequest, base_url: str,
              sdk_version: str | None) -> documented.ExternalWeightsUploadStartResponse | \
            documented.ExternalWeightsUploadStartResponseV039:
        """An open upload and one signed PUT URL per file, in the form the calling SDK reads (0.39: strings;
        0.40 and clients that do not say: objects with the headers to send, none here)."""
        if not self.options.enabled:
            raise PermissionDeniedException("adapter uploads are turned off on this server (--no-external-uploads)")
        spec = self._spec(req)
        project = req.destination_project_id
        if project is not None and not 0 < len(project) <= PROJECT_CHARS:
            raise UserError(f"destination_project_id must be 1 to {PROJECT_CHARS} characters")
        if self.records.uploads.open_uploads(owner) >= self.options.max_open_per_key:
            raise UserError(f"this key has {self.options.max_open_per_key} unfinished uploads "
                            "(--max-open-uploads-per-key): finish one, or wait for it to expire")
        upload_id = f"upload-{uuid.uuid4().hex}"
        expires = int(time.time() + self.options.ttl)
        self.records.uploads.add_upload(upload_id, owner=owner, base_model=req.base_model, lora=asdict(spec),
                                        project_id=project, expires_at=datetime.fromtimestamp(expires, UTC).isoformat(),
                                        files=list(FILES))
        grantee = self.signer.grantee(owner)
        urls = {file: f"{base_url.rstrip('/')}/api/v1/external_weights_upload/{upload_id}/{quote(file)}?"
                      f"{self.signer.sign_upload(upload_id, file, grantee, expires)}" for file in FILES}
        log.info("adapter upload started: %s (%s, LoRA rank %d)", upload_id, req.base_model, spec.rank)
        when = datetime.fromtimestamp(expires, UTC)
        if _older_than(sdk_version, documented.URL_OBJECTS_SDK):
            return documented.ExternalWeightsUploadStartResponseV039(upload_id=upload_id, urls=urls, expires=when)
        return documented.ExternalWeightsUploadStartResponse(
            upload_id=upload_id, urls={file: documented.ExternalWeightsUploadURL(url=url) for file, url in urls.items()},
            expires=when)

    def _spec(self, req: documented.ExternalWeightsUploadStartRequest) -> LoraSpec:
        if req.base_model not in self.base_models:
            raise UserError(f"unknown base model {req.base_model!r}; this server serves: {', '.join(self.base_models)}")
        lora = req.lora_config
        spec = LoraSpec(rank=lora.rank, seed=lora.seed or 0, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                        train_unembed=lora.train_unembed)
        spec.validate()
        if spec.rank > self.max_lora_rank:
            raise UserError(f"LoRA rank {spec.rank} is above this server's --max-lora-rank {self.max_lora_rank}")
        return spec

    def bound(self, base_model: str, spec: LoraSpec, file: str) -> int:
        """The most bytes ``file`` of an adapter of ``spec`` on ``base_model`` can hold: every weight of its groups
        adapted, float32, in the largest naming (``ModelFacts.lora_file_bound``), and its header."""
        if file == ADAPTER_CONFIG:
            return CONFIG_BYTES
        groups = self.scheduler.trainers.facts[base_model].lora_file_bound
        numbers = sum(groups.get(group, (0, 0))[0] for group in spec.groups())
        tensors = sum(groups.get(group, (0, 0))[1] for group in spec.groups())
        return 4 * spec.rank * numbers + HEADER_BYTES_PER_TENSOR * tensors + CONFIG_BYTES

    # ---- PUT --------------------------------------------------------------------------------------------------------
    async def receive(self, upload_id: str, file: str, expires: int, grantee: str, signature: str,
                      length: int | None, body: AsyncIterator[bytes]) -> None:
        """Store one file PUT to its signed URL. Needs no API key: the signature is the permission, and the upload
        is re-checked now (unexpired, its key's, still open). A URL takes one complete PUT; one that fails midway
        stores nothing and may be tried again."""
        if not self.signer.valid_upload(upload_id, file, grantee, expires, signature):
            raise PermissionDeniedException("this upload URL is invalid or has expired; start a new upload")
        row = self.records.uploads.upload(upload_id)
        if row is None or self.signer.grantee(row["owner"]) != grantee:
            raise NotFound(f"upload {upload_id} not found (it expired, or was finished or refused)")
        if self.registered_keys and not self.records.tenants.key_active(row["owner"]):
            raise PermissionDeniedException(f"the key that started upload {upload_id} was revoked")
        if file not in self.records.uploads.files(upload_id):
            raise NotFound(f"upload {upload_id} takes no file {file!r}; it takes {', '.join(FILES)}")
        if row["state"] != OPEN:
            raise ClientException(f"upload {upload_id} is already finished", status_code=409)
        limit = self.bound(row["base_model"], LoraSpec(**json.loads(row["lora_config"])), file)
        if length is not None and length > limit:
            raise _too_large(file, length, limit)
        if not self.records.uploads.claim_file(upload_id, file):
            raise ClientException(f"{file} of upload {upload_id} was uploaded already: each URL takes one PUT; start "
                                  "a new upload to send other files", status_code=409)
        directory = self.root / upload_id
        partial = directory / f".{file}.partial"
        try:
            with writing(directory):
                size = await _write(body, partial, limit, file)
                await asyncio.to_thread(os.replace, partial, directory / file)
        except DiskFull as exc:
            partial.unlink(missing_ok=True)
            self.records.uploads.release_file(upload_id, file)
            raise HTTPException(f"no space left on this server's storage for {file} ({exc}); its URL may be used "
                                "again once the operator frees space", status_code=507) from None
        except BaseException:
            partial.unlink(missing_ok=True)
            self.records.uploads.release_file(upload_id, file)
            raise
        if not self.records.uploads.file_received(upload_id, file, size):  # swept meanwhile: nothing to keep it for
            await asyncio.to_thread(shutil.rmtree, directory, True)
            raise NotFound(f"upload {upload_id} expired while {file} was being sent")
        log.info("adapter upload %s: %s received (%d bytes)", upload_id, file, size)

    # ---- finish -----------------------------------------------------------------------------------------------------
    async def finish(self, owner: str, upload_id: str) -> documented.ExternalWeightsUploadFinishResponse:
        """Check the uploaded adapter in the trainer of its base model and make it an ``external_weights``
        checkpoint in a new training run (listed like a copy: it cannot be trained itself; load it into a training
        client). Finishing a finished upload answers its path again."""
        row = self.records.uploads.upload(upload_id, owner)
        if row is None:
            raise NotFound(f"upload {upload_id} not found (it expired, was refused, or is another key's)")
        if row["state"] == FINISHED:
            return documented.ExternalWeightsUploadFinishResponse(tinker_path=row["tinker_path"])
        missing = [name for name, f in self.records.uploads.files(upload_id).items() if f["state"] != RECEIVED]
        if missing:
            raise UserError(f"upload {upload_id} lacks {', '.join(missing)}: PUT every file to its URL, then finish")
        if not self.records.uploads.claim_finish(upload_id):
            raise ClientException(f"upload {upload_id} is being finished by another request", status_code=409)
        spec = LoraSpec(**json.loads(row["lora_config"]))
        run_id = f"upload-{uuid.uuid4().hex[:16]}"
        path = tinker_path(run_id, "external", CHECKPOINT_NAME)
        staging, uid = self.checkpoints.staging(path), self.checkpoints.new_uid()
        try:
            await asyncio.to_thread(_link_files, self.root / upload_id, staging)
            await self.scheduler.trainer_for(row["base_model"]).import_adapter(
                str(staging), spec, str(self.checkpoints.sampler_copy(staging)))
            size = await asyncio.to_thread(self.checkpoints.publish, staging, path, uid)
        except BaseException as exc:
            await asyncio.to_thread(shutil.rmtree, self.checkpoints.root / run_id, True)  # a new run: nothing else
            if not isinstance(exc, UserError):
                self.records.uploads.reopen(upload_id)
                raise
            self.records.uploads.delete_upload(upload_id)
            await asyncio.to_thread(shutil.rmtree, self.root / upload_id, True)
            log.info("adapter upload %s refused: %s", upload_id, exc)
            raise UserError(f"upload {upload_id} is not a LoRA adapter of {row['base_model']} as its lora_config "
                            f"says: {exc}. Nothing was kept; start a new upload") from None
        self.records.runs.create_model(run_id, session_id="", owner=owner, base_model=row["base_model"],
                                       lora=asdict(spec), user_metadata={"uploaded_as": upload_id},
                                       project_id=row["project_id"])
        self.records.runs.set_model_status(run_id, "an uploaded adapter")
        self.records.checkpoints.add_checkpoint(path, uid=uid, training_run_id=run_id,
                                                checkpoint_id=parse_path(path).checkpoint_id, kind="external",
                                                owner=owner, base_model=row["base_model"], size_bytes=size,
                                                expires_at=None, user_metadata=None)
        self.records.uploads.finished(upload_id, owner, path)
        await asyncio.to_thread(shutil.rmtree, self.root / upload_id, True)
        log.info("adapter uploaded: %s (%d bytes, LoRA rank %d on %s)", path, size, spec.rank, row["base_model"],
                 extra={"event": "checkpoint_saved", "model_id": run_id, "path": path, "bytes": size})
        return documented.ExternalWeightsUploadFinishResponse(tinker_path=path)

    def discard(self, upload_id: str) -> None:
        """Forget an upload and delete its files."""
        self.records.uploads.delete_upload(upload_id)
        shutil.rmtree(self.root / upload_id, ignore_errors=True)

    def sweep_expired(self) -> int:
        """Delete expired uploads (finished ones keep their checkpoint; only the upload's record goes)."""
        expired = self.records.uploads.expired_uploads()
        for upload_id in expired:
            self.discard(upload_id)
        return len(expired)


def _link_files(source: Path, staging: Path) -> None:
    """The upload's files into the staging directory: hard links (the upload keeps its files until the checkpoint is
    made), or copies where the two lie on different filesystems."""
    staging.mkdir()
    for file in FILES:
        try:
            os.link(source / file, staging / file)
        except OSError:
            shutil.copyfile(source / file, staging / file)


async def _write(body: AsyncIterator[bytes], target: Path, limit: int, file: str) -> int:
    """Stream ``body`` into ``target``, refusing it as soon as it passes ``limit`` bytes; returns its size. Writes go
    to a thread in chunks, so a large upload never holds the event loop."""
    await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
    handle = await asyncio.to_thread(open, target, "wb")
    size, pending, held = 0, [], 0
    try:
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                raise _too_large(file, size, limit)
            pending.append(chunk)
            held += len(chunk)
            if held >= WRITE_CHUNK:
                await asyncio.to_thread(handle.writelines, pending)
                pending, held = [], 0
        await asyncio.to_thread(handle.writelines, pending)
        await asyncio.to_thread(os.fsync, handle.fileno())
    finally:
        await asyncio.to_thread(handle.close)
    return size


def _too_large(file: str, size: int, limit: int) -> ClientException:
    return ClientException(f"{file} has {size} bytes or more; an adapter of this base model, rank and lora_config holds at "
                           f"most {limit} (every weight it may adapt, in float32)", status_code=413)


def _older_than(version: str | None, release: tuple[int, int]) -> bool:
    """Whether an SDK version string (``X-Stainless-Package-Version``) names a release before ``release``; an
    unknown or absent one is taken as current."""
    with contextlib.suppress(ValueError, AttributeError):
        major, minor = (int(part) for part in version.split(".")[:2])
        return (major, minor) < release
    return False
