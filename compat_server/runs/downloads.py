"""Time-limited signed URLs for checkpoint files, served by this server itself.

A URL names one file of one save of a checkpoint (its uid), the key it was given to, and an expiry time, signed with
HMAC-SHA256 under a key kept in the data directory (created once, readable by the server's user only), so URLs stay
valid across restarts and its holder can fetch the file with plain HTTP, without an API key, until it expires — and
only while that key may still read that save (checked at every download by ``RunsService.download_file``).

The key appears in a URL only as ``grantee``: an HMAC of its tenant identity, which reveals nothing of the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode


@dataclass(frozen=True)
class DownloadGrant:
    """What a download URL was issued for."""

    tinker_path: str
    uid: str
    """The save it names: a later save under the same path has another uid."""
    grantee: str
    """``UrlSigner.grantee`` of the key that asked for the URL."""


class UrlSigner:
    def __init__(self, key_path: Path, ttl_seconds: float) -> None:
        self.ttl_seconds = ttl_seconds
        if not key_path.exists():
            key_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(32))
        self._key = key_path.read_bytes()

    def grantee(self, owner: str) -> str:
        """An opaque, stable stand-in for a tenant in URLs."""
        return hmac.new(self._key, f"grantee\n{owner}".encode(), hashlib.sha256).hexdigest()[:32]

    def _mac(self, *fields: str | int) -> str:
        return hmac.new(self._key, "\n".join(map(str, fields)).encode(), hashlib.sha256).hexdigest()

    def _signature(self, grant: DownloadGrant, file: str, expires: int) -> str:
        return self._mac(grant.tinker_path, grant.uid, grant.grantee, file, expires)

    def sign(self, grant: DownloadGrant, file: str) -> tuple[int, str]:
        """(expiry as a unix time, the URL's query string) for a URL to ``file`` under ``grant``."""
        expires = int(time.time() + self.ttl_seconds)
        return expires, urlencode({"expires": expires, "checkpoint": grant.uid, "grantee": grant.grantee,
                                   "signature": self._signature(grant, file, expires)})

    def valid(self, grant: DownloadGrant, file: str, expires: int, signature: str) -> bool:
        """The signature matches (compared in constant time) and the expiry has not passed."""
        expected = self._signature(grant, file, expires)
        return hmac.compare_digest(expected.encode(), signature.encode()) and time.time() < expires

    def sign_upload(self, upload_id: str, file: str, grantee: str, expires: int) -> str:
        """The query string of a PUT URL for ``file`` of an upload, until ``expires`` (a unix time). Signed in its
        own domain ("upload"), so no download signature is ever a valid upload one, or the reverse."""
        return urlencode({"expires": expires, "grantee": grantee,
                          "signature": self._mac("upload", upload_id, grantee, file, expires)})

    def valid_upload(self, upload_id: str, file: str, grantee: str, expires: int, signature: str) -> bool:
        expected = self._mac("upload", upload_id, grantee, file, expires)
        return hmac.compare_digest(expected.encode(), signature.encode()) and time.time() < expires
