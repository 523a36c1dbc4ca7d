"""Short-lived tokens for the tinker SDK's key exchange (``pjwt_auth_enabled``).

The SDK trades its ``tml-`` key for a JWT at ``/api/v1/auth/token`` and then sends the JWT in ``X-API-Key``,
refreshing it at half its lifetime; ``RestClient.whoami`` reads its identity from the token's claims. A token names
its tenant (the key's hash, as every record does), is signed with HMAC-SHA256 under a key derived from the server's
own signing key, and is only as good as the key behind it: ``--auth keys`` re-checks that key at every request.
"""

from __future__ import annotations

import hashlib
import hmac
import time

import jwt

ALGORITHM = "HS256"
ORG = "compat-server"


class TokenIssuer:
    def __init__(self, signing_key: bytes, ttl_seconds: float) -> None:
        self._key = hmac.new(signing_key, b"sdk-token", hashlib.sha256).digest()
        self.ttl_seconds = ttl_seconds

    def issue(self, owner: str, name: str) -> str:
        issued = int(time.time())
        claims = {"sub": f"tml:user:{owner[:24]}", "org_id": ORG, "email": f"{name}@{ORG}", "tenant": owner,
                  "iat": issued, "exp": issued + int(self.ttl_seconds)}
        return jwt.encode(claims, self._key, algorithm=ALGORITHM)

    def tenant(self, token: str) -> str | None:
        """The tenant a valid, unexpired token names; None for anything else."""
        try:
            claims = jwt.decode(token, self._key, algorithms=[ALGORITHM], options={"require": ["exp", "tenant"]})
        except jwt.PyJWTError:
            return None
        tenant = claims.get("tenant")
        return tenant if isinstance(tenant, str) else None
