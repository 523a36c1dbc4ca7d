"""API keys → tenant identity.

Tinker clients send ``X-API-Key: tml-…``; OpenAI clients send ``Authorization: Bearer …``. A tenant is identified
by a hash of its key, which is all the records ever hold.
"""

from __future__ import annotations

import hashlib
import secrets

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException

KEY_PREFIX = "tml-"


def owner_of(key: str) -> str:
    """The tenant identity stored with every record: a SHA-256 of the key, never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()


def credential(connection: ASGIConnection) -> str:
    """The caller's key (or SDK token) from ``X-API-Key`` or ``Authorization: Bearer``; 401 when absent or malformed.
    """
    key = connection.headers.get("x-api-key")
    if not key:
        auth = connection.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not key:
        raise NotAuthorizedException("missing API key: send X-API-Key (tinker) or Authorization: Bearer (OpenAI)")
    if key.count(".") == 2 and not key.startswith(KEY_PREFIX):
        return key  # a token from /api/v1/auth/token (three base64url parts)
    if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 1:
        raise NotAuthorizedException(f"invalid API key: keys start with {KEY_PREFIX!r}")
    return key


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


async def provide_owner(request: ASGIConnection) -> str:
    """Litestar dependency: the calling tenant's identity. ``--auth open``: any well-formed key is its own tenant;
    ``--auth keys``: only keys registered with ``compat-server keys create`` and not revoked. A token the SDK got for
    its key stands for that key; an expired or forged one answers ``invalid_token``, on which the SDK exchanges its
    key again."""
    services = request.app.state.services
    presented = credential(request)
    if presented.startswith(KEY_PREFIX):
        owner = owner_of(presented)
    elif (tenant := services.tokens.tenant(presented)) is not None:
        owner = tenant
    else:
        raise NotAuthorizedException("invalid or expired token: exchange the API key again at /api/v1/auth/token",
                                     headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
    if services.config.auth_mode == "keys" and not services.records.key_active(owner):
        raise NotAuthorizedException("unknown or revoked API key: this server accepts only keys created with "
                                     "`compat-server keys create`")
    services.records.note_key_use(owner)
    return owner
