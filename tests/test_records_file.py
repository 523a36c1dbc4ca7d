"""The records file: one written before checkpoints had identities (schema 1) is upgraded in place at start, and a
damaged one is refused with a message that says how to recover."""

from __future__ import annotations

import subprocess
import sys

import sqlite_utils

from compat_server.records import SCHEMA_VERSION, Records
from compat_server.runs.checkpoint_store import CheckpointStore

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
    store = CheckpointStore(tmp_path / "checkpoints", min_ttl_seconds=3600)
    assert store.adopt_unversioned(records.checkpoints.all_checkpoints()) == 1
    assert store.adopt_unversioned(records.checkpoints.all_checkpoints()) == 0  # a second start moves nothing

    assert sorted(row["version"] for row in records.file.db["schema_version"].rows) == [1, SCHEMA_VERSION]
    row, directory = store.readable(records, "bob", PATH)
    assert row["uid"] and directory == legacy / row["uid"]
    assert (directory / "adapter_config.json").read_text() == "{}"
    assert records.samplers.sampler("s:sample:0", "bob")["checkpoint_uid"] is None  # refused at its next use


def test_a_damaged_records_file_is_refused_at_start_with_how_to_recover(tmp_path):
    path = tmp_path / "data" / "records.sqlite3"
    records = Records(path)
    for i in range(300):  # a few dozen pages
        records.sessions.create_session(f"session-{i}", "owner", tags=["t" * 50], user_metadata={"k": "v" * 100},
                                    sdk_version="0", project_id=None)
    records.file.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    records.file.db.conn.close()
    with open(path, "r+b") as handle:  # scribble over the headers of some b-tree pages, as a bad disk might
        for page in (3, 5, 8):
            handle.seek(4096 * page)
            handle.write(b"\xff" * 16)

    data_dir = str(path.parent)
    for command in (["serve", "--host", "127.0.0.1", "--port", "1", "--data-dir", data_dir],
                    ["keys", "--data-dir", data_dir, "list"]):
        done = subprocess.run([sys.executable, "-m", "compat_server.cli", *command],
                              capture_output=True, text=True, timeout=120, check=False)
        said = done.stdout + done.stderr
        assert done.returncode == 2, said
        assert f"the records file {path} is damaged" in said and ".recover" in said and "backup" in said
