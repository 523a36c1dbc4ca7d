"""Account routes of the SDK's ``RestClient`` / ``AdminClient`` and the ``tinker auth`` CLI: audit log, storage and
usage, session trace export, and the calling key itself. HTTP only."""

from __future__ import annotations

import asyncio
from datetime import date, datetime

from litestar import MediaType, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from tinker import types

from compat_server.access.auth import require_key
from compat_server.account.service import trace_json
from compat_server.services import Services

API = "/api/v1"


@get(f"{API}/audit")
async def audit_log(owner: NamedDependency[str], services: NamedDependency[Services],
                    event_type: FromQuery[str] = "all", day: FromQuery[date | None] = None) -> types.AuditLogResponse:
    """The calling key's own mutating actions on one UTC day (today by default)."""
    return services.account.audit_log(owner, event_type, day)


@get(f"{API}/billing/usage/checkpoints/current")
async def checkpoint_storage(owner: NamedDependency[str], services: NamedDependency[Services],
                             project_id: FromQuery[str | None] = None) -> types.CurrentCheckpointStorageUsageResponse:
    return services.account.storage_usage(owner, project_id)


@get(f"{API}/billing/usage/events")
async def usage_events(owner: NamedDependency[str], services: NamedDependency[Services],
                       starting_on: FromQuery[datetime], ending_before: FromQuery[datetime]) -> types.BillingUsageResponse:
    request = types.GetBillingUsageRequest(starting_on=starting_on, ending_before=ending_before)
    return services.account.usage_events(owner, request)


@get(f"{API}/sessions/{{session_id:str}}/trace_export")
async def trace_export(request: Request, session_id: FromPath[str], owner: NamedDependency[str],
                       services: NamedDependency[Services]) -> dict:
    """Built on request from the records, so it is ready at once: the SDK's first poll gets the URL."""
    return {"status": "ready", "url": services.account.trace_url(owner, session_id, str(request.base_url))}


@get(f"{API}/sessions/{{session_id:str}}/trace.json")
async def trace_download(session_id: FromPath[str], expires: FromQuery[int], grantee: FromQuery[str],
                         signature: FromQuery[str], services: NamedDependency[Services]) -> Response[bytes]:
    """Needs no API key: the URL's signature is the permission, re-checked against the session as it is now. The
    trace is built and encoded in a worker thread (up to 100,000 events: seconds the event loop must not spend)."""
    requests = services.account.trace_requests(session_id, grantee, expires, signature)
    return Response(await asyncio.to_thread(trace_json, session_id, requests), media_type=MediaType.JSON)


@post(f"{API}/auth/token", status_code=200)
async def auth_token(request: Request, owner: NamedDependency[str],
                     services: NamedDependency[Services]) -> types.AuthTokenResponse:
    """The SDK's key exchange (``pjwt_auth_enabled``): a short-lived token standing for the caller's key, which only
    the key itself may ask for (``require_key``)."""
    require_key(request)
    return types.AuthTokenResponse(jwt=services.account.token(owner, services.tokens))


@get(f"{API}/auth/apikey/me")
async def own_key(owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    return services.account.key_info(owner, services.config.auth_mode)


@delete(f"{API}/auth/apikey/me", status_code=200)
async def revoke_own_key(owner: NamedDependency[str], services: NamedDependency[Services]) -> None:
    services.account.revoke_own_key(owner)


ACCOUNT_ROUTES = [auth_token, audit_log, checkpoint_storage, usage_events, trace_export, trace_download, own_key,
                  revoke_own_key]
