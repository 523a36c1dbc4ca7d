"""A data directory written before checkpoints had identities (records schema 1) is upgraded in place at start."""

from __future__ import annotations

import sqlite_utils

from compat_server.checkpoints import CheckpointStore
from compat_server.records import SCHEMA_VERSION, Records

PATH = "tinker://run-1/sampler_weights/old"


def test_schema_1_checkpoints_get_an_identity_and_a_save_directory_and_old_sessions_are_not_trusted(tmp_path):
    db = sqlite_utils.Database(tmp_path / "records.sqlite3")  # the tables as schema 1 wrote them
    db["schema_version"].insert({"version": 1, "applied": "2026-01-01T00:00:00+00:00"}, pk="version")
    db["checkpoints"].insert({
        "tinker_path": PATH, "training_run_id": "run-1", "checkpoint_id": "sampler_weights/old", "kind": "sampler",
        "owner": "alice", "base_model": "m", "size_bytes": 2, "created": "2026-01-01T00:00:00+00:00",
        "expires_at": None, "public": 1, "user_metadata": "{}"}, pk="tinker_path")
    db["samplers"].insert({
        "id": "s:sample:0", "session_id": "s", "owner": "bob", "base_model": "m", "kind": "checkpoint",
        "model_path": PATH, "model_id": None, "adapter_key": PATH, "adapter_dir": "x", "created": "2026"}, pk="id")
    legacy = tmp_path / "checkpoints" / "run-1" / "sampler_weights" / "old"
    legacy.mkdir(parents=True)
    (legacy / "adapter_config.json").write_text("{}")

    records = Records(tmp_path / "records.sqlite3")
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.adopt_unversioned(records.all_checkpoints()) == 1
    assert store.adopt_unversioned(records.all_checkpoints()) == 0  # a second start moves nothing

    assert sorted(row["version"] for row in records.db["schema_version"].rows) == [1, SCHEMA_VERSION]
    row, directory = store.readable(records, "bob", PATH)
    assert row["uid"] and directory == legacy / row["uid"]
    assert (directory / "adapter_config.json").read_text() == "{}"
    assert records.sampler("s:sample:0", "bob")["checkpoint_uid"] is None  # refused at its next use
