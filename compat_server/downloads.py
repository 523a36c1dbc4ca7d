"""Time-limited signed URLs for checkpoint files, served by this server itself.

A URL names one file of one checkpoint and an expiry time, signed with HMAC-SHA256 under a key kept in the data
directory (created once, readable by the server's user only), so URLs stay valid across restarts and anyone holding
one can fetch the file with plain HTTP until it expires, without an API key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path


class UrlSigner:
    def __init__(self, key_path: Path, ttl_seconds: float) -> None:
        self.ttl_seconds = ttl_seconds
        if not key_path.exists():
            key_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(32))
        self._key = key_path.read_bytes()

    def _signature(self, tinker_path: str, file: str, expires: int) -> str:
        message = f"{tinker_path}\n{file}\n{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(self, tinker_path: str, file: str) -> tuple[int, str]:
        """(expiry as a unix time, signature) for a URL to ``file`` of ``tinker_path``."""
        expires = int(time.time() + self.ttl_seconds)
        return expires, self._signature(tinker_path, file, expires)

    def valid(self, tinker_path: str, file: str, expires: int, signature: str) -> bool:
        """The signature matches (compared in constant time) and the expiry has not passed."""
        expected = self._signature(tinker_path, file, expires)
        return hmac.compare_digest(expected.encode(), signature.encode()) and time.time() < expires
