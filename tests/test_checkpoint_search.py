"""Checkpoint search over the records themselves (``compat_server.runs.search``): every filter in the query, keyset
paging newest first that neither skips nor repeats, and a search that stops after ``SCAN_LIMIT`` checkpoints with a
cursor where it stopped. The same search through the real server: ``test_external_uploads``."""

from __future__ import annotations

import pytest
from tinker import types

from compat_server.records import Records
from compat_server.runs import search
from contract import documented


@pytest.fixture
def records(tmp_path) -> Records:
    records = Records(tmp_path / "records.sqlite3")
    records.sessions.create_session("s1", "alice" * 4, tags=[], user_metadata={}, sdk_version="0", project_id="p1")
    for index in range(30):
        owner = "alice" * 4 if index % 3 else "bob" * 6
        run = f"run-{index % 2}" if owner.startswith("alice") else "bob-run"
        if index == 0:
            records.runs.create_model("run-0", session_id="s1", owner="alice" * 4, base_model="m", lora={"rank": 1},
                                      user_metadata=None)
        records.checkpoints.add_checkpoint(
            f"tinker://{run}/sampler_weights/c{index:02d}", uid=f"{index:032x}", training_run_id=run,
            checkpoint_id=f"sampler_weights/c{index:02d}", kind="sampler" if index % 2 else "training", owner=owner,
            base_model="m" if index < 20 else "n", size_bytes=1, expires_at=None,
            user_metadata={"even": str(index % 2 == 0)})
    records.checkpoints.set_checkpoint_public("tinker://bob-run/sampler_weights/c03", True)
    return records


def walk(records: Records, key: str, **fields) -> list[str]:
    names, cursor = [], None
    while True:
        page = search.search_checkpoints(records, key, documented.CheckpointSearchRequest(cursor=cursor, **fields))
        names += [c.checkpoint_id.split("/")[-1] for c in page.checkpoints]
        if (cursor := page.next_cursor) is None:
            return names


def test_filters_and_pages_walk_every_match_once_newest_first(records, monkeypatch):
    alice = "alice" * 4
    own = [f"c{i:02d}" for i in reversed(range(30)) if i % 3]
    assert walk(records, alice, limit=1) == own == walk(records, alice, limit=7)
    monkeypatch.setattr(search, "SCAN", 4)
    monkeypatch.setattr(search, "SCAN_LIMIT", 5)  # short pages with cursors where each search stopped
    assert walk(records, alice, limit=3, user_metadata={"even": "True"}) == [n for n in own if int(n[1:]) % 2 == 0]
    assert walk(records, alice, checkpoint_type="sampler", base_models=["n"]) == \
        [n for n in own if int(n[1:]) % 2 and int(n[1:]) >= 20]
    assert walk(records, alice, base_models=[]) == []
    assert walk(records, alice, project_ids=["p1"]) == [n for n in own if int(n[1:]) % 2 == 0]  # run-0 is in s1
    assert walk(records, alice, owner=types.AccessibleSearchOwner()) == sorted(own + ["c03"], reverse=True)
    bob_urn = search.owner_urn("bob" * 6)
    assert walk(records, alice, owner=types.UserSearchOwner(owner_urns=[bob_urn])) == ["c03"]  # only the published
    with pytest.raises(search.NotFound, match="'p2'"):
        walk(records, alice, project_ids=["p2"])
