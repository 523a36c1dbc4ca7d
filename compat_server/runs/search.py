"""Checkpoint search (SDK 0.39's ``RestClient.search_checkpoints``): the checkpoints a key may read, newest first,
filtered and paged with a keyset cursor (``created``, ``uid``), so a page is stable while checkpoints are saved.

Projects here are the key's own (those its sessions and runs are in, and ``default``); another key's checkpoints are
readable only once published. So ``owner``: ``own`` is the key's checkpoints, ``accessible`` adds every checkpoint
published by other keys, ``user`` those of the listed owners (``key:<id>``, as session search names owners) that the
key may read. Every filter but ``user_metadata`` is applied by the records query; one request reads at most
``SCAN_LIMIT`` checkpoints, answering a short page with a cursor where it stopped, so no search holds the server.
"""

from __future__ import annotations

from compat_server.account.service import as_utc
from compat_server.records import Records
from compat_server.runs.service import checkpoint_of, string_metadata
from contract import documented
from shims.errors import NotFound

SCAN = 500
"""Checkpoints read from the records at a time while filling a page."""
SCAN_LIMIT = 20_000
"""The most checkpoints one search request reads (a selective ``user_metadata`` filter over many)."""
URN = "key:"


def owner_urn(owner: str) -> str:
    """How searches name a key (``SessionSummary.owner``)."""
    return f"{URN}{owner[:16]}"


def search_checkpoints(records: Records, owner: str,
                       req: documented.CheckpointSearchRequest) -> documented.CheckpointSearchResponse:
    if req.project_ids is not None:
        unknown = sorted(set(req.project_ids) - records.checkpoints.projects(owner))
        if unknown:
            raise NotFound(f"project {unknown[0]!r} not found: a key searches the projects of its own sessions and "
                           "runs, and 'default'")
    before = (as_utc(req.cursor.last_created_at, "cursor.last_created_at").isoformat(),
              req.cursor.last_checkpoint_uuid) if req.cursor else None
    whose = req.owner
    filters = {"whose": "own" if whose.type == "own" else "accessible", "kind": req.checkpoint_type,
               "base_models": req.base_models, "projects": req.project_ids,
               "owner_prefixes": [urn.removeprefix(URN) for urn in whose.owner_urns] if whose.type == "user" else None}
    found: list[dict] = []
    scanned, last = 0, None
    while len(found) <= req.limit and scanned < SCAN_LIMIT and req.base_models != []:
        rows = records.checkpoints.readable_page(owner, before=before, limit=SCAN, **filters)
        scanned += len(rows)
        for row in rows:
            last = row
            if _metadata_matches(row, req) and len(found) <= req.limit:
                found.append(row)
        if len(rows) < SCAN:
            last = None  # the end: nothing after
            break
        before = (rows[-1]["created"], rows[-1]["uid"])
    page = found[:req.limit]
    if len(found) > req.limit:
        cursor_row = page[-1]
    else:
        cursor_row = last  # stopped at the scan limit: go on from the last checkpoint read
    return documented.CheckpointSearchResponse(
        checkpoints=[checkpoint_of(row) for row in page],
        next_cursor=documented.CheckpointSearchCursor(last_created_at=cursor_row["created"],
                                                      last_checkpoint_uuid=cursor_row["uid"]) if cursor_row else None)


def _metadata_matches(row: dict, req: documented.CheckpointSearchRequest) -> bool:
    metadata = string_metadata(row["user_metadata"])
    return all(metadata.get(key) == value for key, value in req.user_metadata.items())
