"""API keys (``--auth keys``, operator keys): the tenants the server knows, by the hash of their key."""

from __future__ import annotations

from compat_server.records.base import RecordsFile, now


class TenantRecords:
    def __init__(self, file: RecordsFile) -> None:
        self.file = file
        self.db = file.db

    def add_key(self, key_id: str, name: str, owner: str, admin: bool = False) -> None:
        """Register a key by its tenant hash (the key itself is never stored)."""
        if self.db["api_keys"].count_where("name = ?", [name]):
            raise ValueError(f"a key named {name!r} already exists")
        self.file.insert("api_keys", {"id": key_id, "name": name, "owner": owner, "created": now(), "revoked": None,
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
