"""Futures: every request's state and outcome, numbered in the order they finish (``retrieve_futures``' cursor)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from compat_server.records.base import RecordsFile, now
from compat_server.telemetry import traced


class FutureRecords:
    def __init__(self, file: RecordsFile) -> None:
        self.file = file
        self.db = file.db
        self._completions: Iterator[int] | None = None
        """Numbers finished futures in order (``next_completion``); seeded from the file on first use."""

    @traced("records.create_future")
    def create_future(self, request_id: str, *, owner: str, model_id: str | None, seq_id: int | None, kind: str,
                      idempotency_key: str | None, poll_group: str | None = None) -> None:
        """``poll_group`` names the futures one ``retrieve_futures`` poll covers (a sampling session's clone)."""
        self.file.insert("futures", {
            "request_id": request_id, "owner": owner, "model_id": model_id, "seq_id": seq_id, "kind": kind,
            "state": "pending", "created": now(), "idempotency_key": idempotency_key, "poll_group": poll_group,
        })

    def future_by_idempotency_key(self, owner: str, key: str) -> dict | None:
        rows = list(self.db["futures"].rows_where("owner = ? and idempotency_key = ?", [owner, key], limit=1))
        return rows[0] if rows else None

    @traced("records.finish_future")
    def finish_future(self, request_id: str, *, media_type: str, result: bytes) -> None:
        self.file.update("futures", request_id, {"state": "complete", "finished": now(), "media_type": media_type,
                                                 "result": result, "completion_seq": self.next_completion()})

    @traced("records.fail_future")
    def fail_future(self, request_id: str, *, error: str, category: str) -> None:
        self.file.update("futures", request_id, {"state": "failed", "finished": now(), "error": error,
                                                 "category": category, "completion_seq": self.next_completion()})

    @traced("records.future")
    def future(self, request_id: str, owner: str) -> dict | None:
        return self.file.owned("futures", request_id, owner)

    def next_completion(self) -> int:
        """Finished futures are numbered in the order they finish: the cursor of ``retrieve_futures``. The
        numbering goes on from the file's highest, so a cursor a client holds across a restart stays meaningful."""
        if self._completions is None:
            highest = self.db.execute("SELECT max(completion_seq) FROM futures").fetchone()[0] or 0
            self._completions = itertools.count(highest + 1)
        return next(self._completions)

    def completions_after(self, owner: str, poll_group: str, cursor: int, limit: int) -> list[dict]:
        """The group's futures finished after ``cursor``, oldest first (request id, state, payload size, seq)."""
        return [dict(zip(("request_id", "state", "size", "completion_seq"), row)) for row in self.db.execute(
            "SELECT request_id, state, length(result), completion_seq FROM futures WHERE poll_group = ? AND owner = ? "
            "AND completion_seq > ? ORDER BY completion_seq LIMIT ?", [poll_group, owner, cursor, limit])]

    def forget_results(self, owner: str, poll_group: str, request_ids: list[str]) -> None:
        """Drop the payloads a client reports fully retrieved (``retrieved_request_ids``); their state stays."""
        with self.db.conn:  # one committed transaction, like every other write here
            self.db.conn.executemany("UPDATE futures SET result = NULL WHERE request_id = ? AND owner = ? AND "
                                     "poll_group = ? AND state = 'complete'",
                                     [(request_id, owner, poll_group) for request_id in request_ids])

    def recent_failures(self, owner: str, limit: int) -> list[dict]:
        """The owner's latest failed futures (the dashboard's recent errors)."""
        return list(self.db["futures"].rows_where(
            "owner = ? AND state = 'failed'", [owner], order_by="finished desc", limit=limit,
            select="request_id, model_id, kind, finished, error, category"))
