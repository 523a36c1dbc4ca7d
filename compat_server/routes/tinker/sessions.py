"""Client bootstrap and session routes: config; a session's creation, heartbeats and end; listing, getting and searching
a key's sessions and moving one to a project; telemetry, health and capabilities. HTTP only: the work is in
``compat_server.sessions`` (ending a session, in the training service)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from litestar import get, post, put
from litestar.di import NamedDependency
from litestar.params import Body, FromPath
from tinker import types

from compat_server.routes.tinker.runs import Limit, Offset
from compat_server.services import Services
from shims.errors import UserError

log = logging.getLogger("compat_server.sessions")
API = "/api/v1"


@post(f"{API}/client/config", status_code=200)
async def client_config(owner: NamedDependency[str],
                        services: NamedDependency[Services]) -> types.ClientConfigResponse:
    """Feature flags for the SDK: it exchanges its key for a short-lived token (``/api/v1/auth/token``) and sends
    uncompressed protobuf bodies; a sampling client polls all its futures at once (``retrieve_futures``) and its
    unpickled clones ask for their number (``join_sampling_session``); custom losses are uploaded and run in the
    trainer (``custom_loss_server_side``) unless ``--client-side-custom-losses``."""
    return types.ClientConfigResponse(pjwt_auth_enabled=True, proto_compress_fwdbwd=False,
                                      sample_use_retrieve_futures=True, sample_join_sampling_session=True,
                                      custom_loss_server_side=services.config.custom_loss_server_side)


@post(f"{API}/client/dynamic_config", status_code=200)
async def client_dynamic_config(owner: NamedDependency[str]) -> types.ClientDynamicConfigResponse:
    """An abandoned sample is cancelled on the server at once (``cancel_future``)."""
    return types.ClientDynamicConfigResponse(sample_cancel_enabled=True)


@post(f"{API}/create_session", status_code=200)
async def create_session(owner: NamedDependency[str], services: NamedDependency[Services],
                         data: Annotated[types.CreateSessionRequest, Body()]) -> types.CreateSessionResponse:
    """Its display name, project, tags and metadata are checked against the session limits (``--max-session-…``)."""
    session_id = services.sessions.create(owner, data)
    log.info("session created: %s (sdk %s)", session_id, data.sdk_version)
    return types.CreateSessionResponse(session_id=session_id)


@post(f"{API}/session_heartbeat", status_code=200)
async def session_heartbeat(owner: NamedDependency[str], services: NamedDependency[Services],
                            data: Annotated[types.SessionHeartbeatRequest, Body()]) -> types.SessionHeartbeatResponse:
    """An unknown or expired session answers 410 Gone, which stops the SDK's heartbeat loop instead of retrying
    forever."""
    services.sessions.heartbeat(owner, data.session_id)
    return types.SessionHeartbeatResponse(type="session_heartbeat")


@post(f"{API}/sessions/{{session_id:str}}/finish", status_code=200)
async def finish_session(session_id: FromPath[str], owner: NamedDependency[str], services: NamedDependency[Services],
                         data: Annotated[dict[str, Any], Body()]) -> dict:
    """Closing a session records why (success / errored / interrupted; the first reason given wins) and ends it:
    its training runs leave the trainer (the SDK rejects further operations on a closed session anyway)."""
    row = services.records.sessions.session(session_id, owner)
    if row is None:
        raise UserError(f"unknown session_id {session_id!r}")
    reason = data.get("reason")
    reason_type = reason.get("type") if isinstance(reason, dict) else None
    if not row["finished"]:
        unloaded = await services.training.end_session(session_id, str(reason_type or "unknown"),
                                                       "its session was closed")
        log.info("session finished: %s (%s); models unloaded: %s", session_id, reason_type or "unknown",
                 ", ".join(unloaded) or "none")
    return {}


@get(f"{API}/sessions")
async def list_sessions(owner: NamedDependency[str], services: NamedDependency[Services],
                        limit: Limit = 20, offset: Offset = 0) -> types.ListSessionsResponse:
    return services.sessions.list_page(owner, limit, offset)


@get(f"{API}/sessions/{{session_id:str}}")
async def get_session(session_id: FromPath[str], owner: NamedDependency[str],
                      services: NamedDependency[Services]) -> types.GetSessionResponse:
    return services.sessions.get(owner, session_id)


@post(f"{API}/sessions/search", status_code=200)
async def search_sessions(owner: NamedDependency[str], services: NamedDependency[Services],
                          data: Annotated[types.SessionSearchRequest, Body()]) -> types.SessionSearchResponse:
    return services.sessions.search(owner, data)


@put(f"{API}/sessions/{{session_id:str}}/project", status_code=200)
async def assign_session_project(session_id: FromPath[str], owner: NamedDependency[str],
                                 services: NamedDependency[Services], data: Annotated[dict[str, Any], Body()]) -> None:
    services.sessions.assign_project(owner, session_id, data.get("project_id"))


@post(f"{API}/telemetry", status_code=200)
async def telemetry(owner: NamedDependency[str], services: NamedDependency[Services],
                    data: Annotated[types.TelemetrySendRequest, Body()]) -> types.TelemetryResponse:
    """SDK telemetry is accepted and counted, not stored: it holds nothing the operator needs."""
    services.records.sessions.count_telemetry(owner, data.session_id, len(data.events))
    return types.TelemetryResponse(status="accepted")


@get(f"{API}/healthz")
async def healthz() -> types.HealthResponse:
    return types.HealthResponse(status="ok")


@get(f"{API}/get_server_capabilities")
async def get_server_capabilities(owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    """The SDK's ``GetServerCapabilitiesResponse``, each model with two fields the SDK ignores and people read:
    what a LoRA adapts on it, by weight group, and which backend its samplers run."""
    return {"supported_models": [
        {**types.SupportedModel(model_name=name, max_context_length=services.trainers.facts[name].max_context,
                                trainable=True, sampleable=True).model_dump(),
         "lora_targets": services.trainers.facts[name].lora_targets,
         "sampler_backend": services.samplers.options.backend}
        for name in services.base_models
    ]}


SESSION_ROUTES = [client_config, client_dynamic_config, create_session, session_heartbeat, finish_session,
                  list_sessions, get_session, search_sessions, assign_session_project, telemetry, healthz,
                  get_server_capabilities]
