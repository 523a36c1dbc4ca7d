"""API keys (``--auth keys``, operator keys) and the stability info recorded per key (stable_reinforce)."""

from __future__ import annotations

import json

from compat_server.records.base import RecordsBase, now


class TenantRecords(RecordsBase):
    # ---- API keys (--auth keys) ----------------------------------------------------------------------------------
    def add_key(self, key_id: str, name: str, owner: str, admin: bool = False) -> None:
        """Register a key by its tenant hash (the key itself is never stored)."""
        if self.db["api_keys"].count_where("name = ?", [name]):
            raise ValueError(f"a key named {name!r} already exists")
        self._insert("api_keys", {"id": key_id, "name": name, "owner": owner, "created": now(), "revoked": None,
                                  "admin": int(admin)})

    def api_keys(self) -> list[dict]:
        return list(self.db["api_keys"].rows_where(order_by="created", select="id, name, created, revoked, admin"))

    def is_admin(self, owner: str) -> bool:
        """An operator key (``keys create --admin``), not revoked: it may see server-wide figures."""
        return self.db["api_keys"].count_where("owner = ? AND revoked IS NULL AND admin = 1", [owner]) > 0

    def revoke_key(self, name_or_id: str) -> bool:
        """Revoke by name or id; False when no active key matches."""
        with self.db.conn:
            return self.db.conn.execute("UPDATE api_keys SET revoked = ? WHERE (name = ? OR id = ?) AND revoked IS NULL",
                                        [now(), name_or_id, name_or_id]).rowcount > 0

    def key_of(self, owner: str) -> dict | None:
        """The active registered key of this tenant, if any (``--auth keys``)."""
        rows = list(self.db["api_keys"].rows_where("owner = ? AND revoked IS NULL", [owner], limit=1))
        return rows[0] if rows else None

    def key_active(self, owner: str) -> bool:
        return self.db["api_keys"].count_where("owner = ? AND revoked IS NULL", [owner]) > 0

    # ---- stability info (stable_reinforce) -------------------------------------------------------------------------
    def record_sequences(self, owner: str, session_id: str,
                         sequences: list[tuple[str, list[int], list[int], list[float]]]) -> None:
        """Store (sequence_id, prompt, sampled tokens, sampler logprobs) per sampled sequence; a retried request
        replaces its own rows."""
        stamp = now()
        self.db["stability_records"].insert_all(({
            "sequence_id": sequence_id, "session_id": session_id, "owner": owner, "prompt": json.dumps(prompt),
            "tokens": json.dumps(tokens), "logprobs": json.dumps(logprobs), "created": stamp, "last_used": stamp,
        } for sequence_id, prompt, tokens, logprobs in sequences), replace=True)

    def recorded_sequence(self, sequence_id: str, owner: str) -> dict | None:
        row = self._owned("stability_records", sequence_id, owner)
        if row is not None:
            row.update({key: json.loads(row[key]) for key in ("prompt", "tokens", "logprobs")})
        return row

    def touch_sequences(self, sequence_ids: list[str]) -> None:
        stamp = now()
        with self.db.conn:
            self.db.conn.executemany("UPDATE stability_records SET last_used = ? WHERE sequence_id = ?",
                                     [(stamp, sid) for sid in sequence_ids])

    def purge_sequences(self, unused_since: str) -> int:
        """Delete stability records not used since ``unused_since``; returns how many."""
        with self.db.conn:
            return self.db.conn.execute("DELETE FROM stability_records WHERE last_used < ?", [unused_since]).rowcount

