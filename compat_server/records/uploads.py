"""Adapter uploads (``external_weights_upload_start`` … ``_finish``): each upload, and each of its files' state, so
that a signed PUT URL is used once and an upload survives a restart until it expires."""

from __future__ import annotations

import json

from compat_server.records.account import AccountRecords
from compat_server.records.base import RecordsFile, now

WAITING, RECEIVING, RECEIVED = "waiting", "receiving", "received"
"""A file's states: its URL not yet used; a PUT streaming it now; stored (its URL spent)."""
OPEN, FINISHING, FINISHED = "open", "finishing", "finished"
"""An upload's states: taking files; being checked and made a checkpoint; done (``tinker_path`` says where)."""


class UploadRecords:
    def __init__(self, file: RecordsFile, account: AccountRecords) -> None:
        self.file = file
        self.db = file.db
        self.account = account

    def add_upload(self, upload_id: str, *, owner: str, base_model: str, lora: dict, project_id: str | None,
                   expires_at: str, files: list[str]) -> None:
        with self.db.conn:
            self.db.conn.execute(
                "INSERT INTO uploads (id, owner, base_model, lora_config, project_id, created, expires_at, state) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [upload_id, owner, base_model, json.dumps(lora), project_id, now(), expires_at, OPEN])
            self.db.conn.executemany("INSERT INTO upload_files (upload_id, file, state, bytes) VALUES (?, ?, ?, 0)",
                                     [(upload_id, name, WAITING) for name in files])
        self.account.audit(owner, "checkpoint_upload_start", upload_id=upload_id, base_model=base_model)

    def upload(self, upload_id: str, owner: str | None = None) -> dict | None:
        """An upload that has not expired (given ``owner``: only if that key started it; another key's looks
        missing)."""
        row = self.file.get("uploads", upload_id)
        if row is None or row["expires_at"] <= now() or (owner is not None and row["owner"] != owner):
            return None
        return row

    def open_uploads(self, owner: str) -> int:
        return self.db["uploads"].count_where("owner = ? AND state != ? AND expires_at > ?", [owner, FINISHED, now()])

    def files(self, upload_id: str) -> dict[str, dict]:
        return {row["file"]: row for row in self.db["upload_files"].rows_where("upload_id = ?", [upload_id])}

    def _move(self, table: str, where: str, args: list, state: str, **values) -> bool:
        assignments = ", ".join(f"[{name}] = ?" for name in ("state", *values))
        with self.db.conn:
            return self.db.conn.execute(f"UPDATE {table} SET {assignments} WHERE {where}",
                                        [state, *values.values(), *args]).rowcount == 1

    def claim_file(self, upload_id: str, file: str) -> bool:
        """Take a file's URL for one PUT: False if it was used (or is in use) already."""
        return self._move("upload_files", "upload_id = ? AND file = ? AND state = ?", [upload_id, file, WAITING],
                          RECEIVING)

    def file_received(self, upload_id: str, file: str, size: int) -> bool:
        """Mark a file stored by the PUT that claimed it; False if its upload is gone meanwhile."""
        return self._move("upload_files", "upload_id = ? AND file = ? AND state = ?", [upload_id, file, RECEIVING],
                          RECEIVED, bytes=size)

    def release_file(self, upload_id: str, file: str) -> None:
        """A PUT that did not complete: its URL may be used again."""
        self._move("upload_files", "upload_id = ? AND file = ? AND state = ?", [upload_id, file, RECEIVING], WAITING)

    def claim_finish(self, upload_id: str) -> bool:
        """Take an open upload for one finish: False if another finish has it."""
        return self._move("uploads", "id = ? AND state = ?", [upload_id, OPEN], FINISHING)

    def reopen(self, upload_id: str) -> None:
        self._move("uploads", "id = ? AND state = ?", [upload_id, FINISHING], OPEN)

    def finished(self, upload_id: str, owner: str, tinker_path: str) -> None:
        self._move("uploads", "id = ?", [upload_id], FINISHED, tinker_path=tinker_path)
        self.account.audit(owner, "checkpoint_upload_finish", upload_id=upload_id, tinker_path=tinker_path)

    def delete_upload(self, upload_id: str) -> None:
        with self.db.conn:
            self.db.conn.execute("DELETE FROM upload_files WHERE upload_id = ?", [upload_id])
            self.db.conn.execute("DELETE FROM uploads WHERE id = ?", [upload_id])

    def expired_uploads(self) -> list[str]:
        """Expired uploads no request is working on now (a PUT streaming a file, a finish making the checkpoint):
        those are swept once their request ends."""
        return [row["id"] for row in self.db["uploads"].rows_where(
            "expires_at <= ? AND state != ? AND id NOT IN (SELECT upload_id FROM upload_files WHERE state = ?)",
            [now(), FINISHING, RECEIVING], select="id")]

    def interrupted(self) -> int:
        """At start, when no request is running: PUTs and finishes that a stopped process left midway are undone
        (their files' URLs usable again, their uploads open again). Returns how many."""
        with self.db.conn:
            files = self.db.conn.execute("UPDATE upload_files SET state = ? WHERE state = ?",
                                         [WAITING, RECEIVING]).rowcount
            uploads = self.db.conn.execute("UPDATE uploads SET state = ? WHERE state = ?", [OPEN, FINISHING]).rowcount
        return files + uploads

    def all_uploads(self) -> list[str]:
        return [row["id"] for row in self.db["uploads"].rows_where(select="id")]
