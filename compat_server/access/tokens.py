"""Short-lived tokens for the tinker SDK's key exchange (``pjwt_auth_enabled``).

The SDK trades its ``tml-`` key for a JWT at ``/api/v1/auth/token`` and then sends the JWT in ``X-API-Key``,
refreshing it at half its lifetime by exchanging the key again (a token never buys another, so a leaked one dies at
its expiry); ``RestClient.whoami`` reads its identity from the token's claims. A token names its tenant (the key's
hash, as every record does), is signed with HMAC-SHA256 under a key derived from the server's own signing key, and
is only as good as the key behind it: ``--auth keys`` re-checks that key at every request.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict

import jwt

ALGORITHM = "HS256"
ORG = "compat-server"
VERIFIED_KEPT = 4096
"""Tokens whose signature was verified, kept (most recently used first out last) so that each request does not
verify the same token again; their expiry is still checked at every use."""


class TokenIssuer:
    def __init__(self, signing_key: bytes, ttl_seconds: float) -> None:
        self._key = hmac.new(signing_key, b"sdk-token", hashlib.sha256).digest()
        self.ttl_seconds = ttl_seconds
        self._verified: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """token → (tenant, expiry): a signature check of the same bytes under the same key cannot change."""

    def issue(self, owner: str, name: str) -> str:
        issued = int(time.time())
        claims = {"sub": f"tml:user:{owner[:24]}", "org_id": ORG, "email": f"{name}@{ORG}", "tenant": owner,
                  "iat": issued, "exp": issued + int(self.ttl_seconds)}
        return jwt.encode(claims, self._key, algorithm=ALGORITHM)

    def tenant(self, token: str) -> str | None:
        """The tenant a valid, unexpired token names; None for anything else."""
        known = self._verified.get(token)
        if known is None:
            try:
                claims = jwt.decode(token, self._key, algorithms=[ALGORITHM],
                                    options={"require": ["exp", "tenant"], "verify_exp": False})
            except jwt.PyJWTError:
                return None
            if not isinstance(claims["tenant"], str):
                return None
            known = self._verified[token] = (claims["tenant"], float(claims["exp"]))
            if len(self._verified) > VERIFIED_KEPT:
                self._verified.popitem(last=False)
        tenant, expires = known
        if time.time() >= expires:  # expired from its ``exp`` second on, as PyJWT would say
            self._verified.pop(token, None)
            return None
        self._verified.move_to_end(token)
        return tenant
