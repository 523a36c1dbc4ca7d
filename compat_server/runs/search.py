"""Checkpoint search (SDK 0.39's ``RestClient.search_checkpoints``): the checkpoints a key may read, newest first,
filtered and paged with a keyset cursor (``created``, ``uid``), so a page is stable while checkpoints are saved.

Projects here are the key's own (those its sessions and runs are in, and ``default``); another key's checkpoints are
readable only once published. So ``owner``: ``own`` is the key's checkpoints, ``accessible`` adds every checkpoint
published by other keys, ``user`` those of the listed owners (``key:<id>``, as session search names owners) that the
key may read.
"""

from __future__ import annotations

from compat_server.account.service import as_utc
from compat_server.records import Records
from compat_server.runs.service import checkpoint_of, string_metadata
from contract import documented
from shims.errors import NotFound

SCAN = 500
"""Checkpoints read from the records at a time while filling a page."""


def owner_urn(owner: str) -> str:
    """How searches name a key (``SessionSummary.owner``)."""
    return f"key:{owner[:16]}"


def search_checkpoints(records: Records, owner: str,
                       req: documented.CheckpointSearchRequest) -> documented.CheckpointSearchResponse:
    if req.project_ids is not None:
        unknown = sorted(set(req.project_ids) - records.checkpoints.projects(owner))
        if unknown:
            raise NotFound(f"project {unknown[0]!r} not found: a key searches the projects of its own sessions and "
                           "runs, and 'default'")
    before = (as_utc(req.cursor.last_created_at, "cursor.last_created_at").isoformat(),
              req.cursor.last_checkpoint_uuid) if req.cursor else None
    found: list[dict] = []
    while len(found) < req.limit + 1:
        rows = records.checkpoints.readable_page(owner, before=before, limit=SCAN)
        found += [row for row in rows if _matches(row, owner, req)]
        if len(rows) < SCAN:
            break
        before = (rows[-1]["created"], rows[-1]["uid"])
    page = found[:req.limit]
    more = len(found) > req.limit and page
    return documented.CheckpointSearchResponse(
        checkpoints=[checkpoint_of(row) for row in page],
        next_cursor=documented.CheckpointSearchCursor(last_created_at=page[-1]["created"],
                                                      last_checkpoint_uuid=page[-1]["uid"]) if more else None)


def _matches(row: dict, owner: str, req: documented.CheckpointSearchRequest) -> bool:
    whose = req.owner
    if whose.type == "own" and row["owner"] != owner:
        return False
    if whose.type == "user" and owner_urn(row["owner"]) not in whose.owner_urns:
        return False
    if req.project_ids is not None and row["project_id"] not in req.project_ids:
        return False
    if req.checkpoint_type is not None and row["kind"] != req.checkpoint_type:
        return False
    if req.base_models is not None and row["base_model"] not in req.base_models:
        return False
    metadata = string_metadata(row["user_metadata"])
    return all(metadata.get(key) == value for key, value in req.user_metadata.items())
