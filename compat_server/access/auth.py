"""API keys → tenant identity.

Tinker clients send ``X-API-Key: tml-…``; OpenAI clients send ``Authorization: Bearer …``. A tenant is identified
by a hash of its key, which is all the records ever hold.
"""

from __future__ import annotations

import hashlib
import secrets

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException

KEY_PREFIX = "tml-"


def owner_of(key: str) -> str:
    """The tenant identity stored with every record: a SHA-256 of the key, never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()


ANONYMOUS = "anonymous"
"""The one tenant that, on an ``--auth open`` server, every caller without a ``tml-`` key shares: OpenAI-API tools
send ``api_key="EMPTY"``, a made-up ``sk-…`` or no key at all, as vLLM's server lets them."""


def credential(connection: ASGIConnection) -> str | None:
    """The caller's key (or SDK token) from ``X-API-Key`` or ``Authorization: Bearer``; None when there is none."""
    key = connection.headers.get("x-api-key")
    if not key:
        auth = connection.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return key or None


def is_token(presented: str) -> bool:
    """Whether ``presented`` is a token from ``/api/v1/auth/token`` (three base64url parts) rather than a key."""
    return presented.count(".") == 2 and not presented.startswith(KEY_PREFIX)


def is_key(presented: str) -> bool:
    return presented.startswith(KEY_PREFIX) and len(presented) > len(KEY_PREFIX)


def require_key(connection: ASGIConnection) -> None:
    """Only an API key buys a token (``/api/v1/auth/token``): a token that bought another would renew itself for as
    long as its key lives, so a leaked one would never run out. The tinker SDK sends its key there, and refreshes by
    exchanging the key again. 403: the caller is known (``provide_owner`` checked the credential), but may not."""
    presented = credential(connection)
    if presented is not None and is_key(presented):
        return
    if presented is not None and is_token(presented):
        raise PermissionDeniedException("a token cannot be exchanged for another token: /api/v1/auth/token takes "
                                        f"the API key ({KEY_PREFIX}…) itself, as the tinker SDK sends it")
    raise PermissionDeniedException(f"/api/v1/auth/token exchanges an API key ({KEY_PREFIX}…) for a token: send the "
                                    "key in X-API-Key or Authorization: Bearer")


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


async def provide_owner(request: ASGIConnection) -> str:
    """Litestar dependency: the calling tenant's identity. ``--auth open``: any ``tml-`` key is its own tenant, and
    every other key (or none) is the one ``ANONYMOUS`` tenant; ``--auth keys``: only keys registered with ``compat-server keys create`` and not revoked. A token the SDK got for
    its key stands for that key; an expired or forged one answers ``invalid_token``, on which the SDK exchanges its
    key again."""
    services = request.app.state.services
    open_auth = services.config.auth_mode == "open"
    presented = credential(request)
    if presented is not None and is_key(presented):
        owner = owner_of(presented)
    elif presented is not None and is_token(presented):
        if (owner := services.tokens.tenant(presented)) is None:
            raise NotAuthorizedException("invalid or expired token: exchange the API key again at /api/v1/auth/token",
                                         headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
    elif open_auth:
        owner = owner_of(ANONYMOUS)
    elif presented is None:
        raise NotAuthorizedException("missing API key: send X-API-Key (tinker) or Authorization: Bearer (OpenAI)")
    else:
        raise NotAuthorizedException(f"invalid API key: keys start with {KEY_PREFIX!r}")
    if not open_auth and not services.records.tenants.key_active(owner):
        raise NotAuthorizedException("unknown or revoked API key: this server accepts only keys created with "
                                     "`compat-server keys create`")
    services.records.account.note_key_use(owner)
    return owner
