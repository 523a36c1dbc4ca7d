"""Wire types that hosted Tinker documents for an SDK release newer than the installed one, pinned here from its
documented type pages until an installed SDK carries them (then the contract tests fail, saying to use the SDK's own
type and delete the one here). A type the installed SDK has is subclassed, only adding the documented fields: the
installed SDK's models ignore fields they do not know, so it still reads what the server sends, and a newer SDK reads
the fields too. A type it lacks is written from its documented fields, on the SDK's own bases (``StrictBase`` for
requests, ``BaseModel`` for responses).

SDK 0.39.0 (documented 2026-11-06, commit 4801e02; the package registry serves 0.38.0):

- ``Checkpoint.base_model``, the base model a checkpoint was trained on, in every checkpoint the REST routes return.
- Adapter upload (experimental): ``POST /api/v1/external_weights_upload_start`` (``ExternalWeightsUploadStartRequest``
  → ``…Response``: an upload id, one signed URL per file to PUT, their expiry), then
  ``POST /api/v1/external_weights_upload_finish`` (``…FinishRequest`` → ``…FinishResponse``: the checkpoint's path).
  0.39 gives each URL as a string; the reference pages of 0.40.0 (commit 3e952a8) as an object with the headers to
  send (``ExternalWeightsUploadURL``).
- Checkpoint search (experimental): ``CheckpointSearchRequest`` → ``CheckpointSearchResponse``, newest first with a
  keyset cursor. The type pages name no route; this server takes it at ``POST /api/v1/checkpoints/search``, beside
  0.38's ``POST /api/v1/sessions/search``. Defaults the pages do not show (``limit`` 50, ``owner`` own,
  ``user_metadata`` empty) are ``SessionSearchRequest``'s.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import AwareDatetime, Field
from tinker import types
from tinker._models import BaseModel, StrictBase

DOCUMENTED_SDK = "0.39.0"
URL_OBJECTS_SDK = (0, 40)
"""The first SDK release that takes each upload URL as ``ExternalWeightsUploadURL`` (an older one, a string)."""


class Checkpoint(types.Checkpoint):
    base_model: str | None = None
    """The base model the checkpoint was trained on."""


class CheckpointsListResponse(types.CheckpointsListResponse):
    checkpoints: list[Checkpoint]


class TrainingRun(types.TrainingRun):
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None


class TrainingRunsResponse(types.TrainingRunsResponse):
    training_runs: list[TrainingRun]


class ExternalWeightsUploadStartRequest(StrictBase):
    base_model: str
    lora_config: types.LoraConfig
    destination_project_id: str | None = None
    """The project the uploaded checkpoint's training run is in; None: the default project."""


class ExternalWeightsUploadURL(BaseModel):
    """SDK 0.40: where to PUT one file, and the headers to send with it."""

    url: str
    headers: dict[str, str] = Field(default_factory=dict)


class ExternalWeightsUploadStartResponse(BaseModel):
    """SDK 0.40's form: each URL an ``ExternalWeightsUploadURL``."""

    upload_id: str
    urls: dict[str, ExternalWeightsUploadURL]
    """Keyed by file name: the files ``save_weights_external`` writes."""
    expires: datetime


class ExternalWeightsUploadStartResponseV039(BaseModel):
    """SDK 0.39's form: each URL a string."""

    upload_id: str
    urls: dict[str, str]
    expires: datetime


class ExternalWeightsUploadFinishRequest(StrictBase):
    upload_id: str


class ExternalWeightsUploadFinishResponse(BaseModel):
    tinker_path: str
    """The external weights checkpoint holding the uploaded adapter."""


class CheckpointSearchCursor(BaseModel):
    last_created_at: AwareDatetime
    last_checkpoint_uuid: str


class CheckpointSearchRequest(StrictBase):
    project_ids: list[str] | None = None
    """Projects to search; None: every project the caller may list. Naming one it may not list is an error."""
    user_metadata: dict[str, str] = Field(default_factory=dict)
    """Exact key/value matches; every pair must hold."""
    checkpoint_type: types.CheckpointType | None = None
    owner: types.SearchOwner = types.OwnSearchOwner()
    base_models: list[str] | None = None
    """Any of these base models; None: all; an empty list matches nothing."""
    limit: int = Field(default=50, ge=1, le=200)
    cursor: CheckpointSearchCursor | None = None


class CheckpointSearchResponse(BaseModel):
    checkpoints: list[Checkpoint]
    next_cursor: CheckpointSearchCursor | None = None


ADDED_FIELDS: dict[type, tuple[str, ...]] = {Checkpoint: ("base_model",)}
"""The fields each documented type adds to the installed SDK's (what the contract tests watch for)."""

NEW_TYPES = ("ExternalWeightsUploadStartRequest", "ExternalWeightsUploadURL", "ExternalWeightsUploadStartResponse",
             "ExternalWeightsUploadFinishRequest", "ExternalWeightsUploadFinishResponse", "CheckpointSearchCursor",
             "CheckpointSearchRequest", "CheckpointSearchResponse")
"""Types documented for a newer SDK that the installed one lacks (the contract tests watch for them)."""
