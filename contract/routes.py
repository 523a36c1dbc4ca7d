"""The Tinker routes this server serves, each tied to the SDK types of its request, response and future result.

A name is a tinker ``types`` class; ``protobuf:X`` is message X of ``tinker.proto.tinker_public_pb2``; None means
the SDK sends or reads no typed body.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    request: str | None
    response: str | None
    future_result: str | None = None
    """For routes answering ``UntypedAPIFuture``: the type ``retrieve_future`` later returns."""


FUTURE = "UntypedAPIFuture"

TINKER_ROUTES: list[Route] = [
    Route("POST", "/api/v1/client/config", "ClientConfigRequest", "ClientConfigResponse"),
    Route("POST", "/api/v1/client/dynamic_config", "ClientConfigRequest", "ClientDynamicConfigResponse"),
    Route("POST", "/api/v1/create_session", "CreateSessionRequest", "CreateSessionResponse"),
    Route("POST", "/api/v1/session_heartbeat", "SessionHeartbeatRequest", "SessionHeartbeatResponse"),
    Route("POST", "/api/v1/sessions/{session_id}/finish", None, None),
    Route("POST", "/api/v1/telemetry", "TelemetrySendRequest", "TelemetryResponse"),
    Route("GET", "/api/v1/healthz", None, "HealthResponse"),
    Route("GET", "/api/v1/get_server_capabilities", None, "GetServerCapabilitiesResponse"),
    Route("POST", "/api/v1/create_model", "CreateModelRequest", FUTURE, "CreateModelResponse"),
    Route("POST", "/api/v1/get_info", "GetInfoRequest", "GetInfoResponse"),
    Route("POST", "/api/v1/forward_backward", "protobuf:ForwardBackwardRequest", FUTURE,
          "protobuf:ForwardBackwardOutput"),
    Route("POST", "/api/v1/optim_step", "OptimStepRequest", FUTURE, "OptimStepResponse"),
    Route("POST", "/api/v1/save_weights", "SaveWeightsRequest", FUTURE, "SaveWeightsResponse"),
    Route("POST", "/api/v1/save_weights_for_sampler", "SaveWeightsForSamplerRequest", FUTURE,
          "SaveWeightsForSamplerResponseInternal"),
    Route("POST", "/api/v1/save_weights_external", "SaveWeightsExternalRequest", FUTURE,
          "SaveWeightsExternalResponseInternal"),
    Route("POST", "/api/v1/load_weights", "LoadWeightsRequest", FUTURE, "LoadWeightsResponse"),
    Route("POST", "/api/v1/unload_model", "UnloadModelRequest", FUTURE, "UnloadModelResponse"),
    Route("POST", "/api/v1/create_sampling_session", "CreateSamplingSessionRequest", "CreateSamplingSessionResponse"),
    Route("GET", "/api/v1/samplers/{sampler_id}", None, "GetSamplerResponse"),
    Route("POST", "/api/v1/asample", "SampleRequest", FUTURE, "protobuf:SampleResponse"),
    Route("POST", "/api/v1/retrieve_future", "FutureRetrieveRequest", None),
    Route("POST", "/api/v1/retrieve_futures", "FuturesRetrieveRequest", "FuturesRetrieveResponse"),
    Route("POST", "/api/v1/cancel_future", None, None),
    Route("POST", "/api/v1/join_sampling_session", "JoinSamplingSessionRequest", "JoinSamplingSessionResponse"),
    Route("POST", "/api/v1/create_custom_loss", "CreateCustomLossRequest", FUTURE, "CreateCustomLossResponse"),
    Route("GET", "/api/v1/training_runs", None, "TrainingRunsResponse"),
    Route("GET", "/api/v1/training_runs/{run_id}", None, "TrainingRun"),
    Route("GET", "/api/v1/training_runs/{run_id}/checkpoints", None, "CheckpointsListResponse"),
    Route("GET", "/api/v1/checkpoints", None, "CheckpointsListResponse"),
    Route("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}", None, None),
    Route("POST", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", None, None),
    Route("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", None, None),
    Route("PUT", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", None, None),
    Route("GET", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls", None,
          "ExternalWeightsUrlsResponse"),
    Route("POST", "/api/v1/weights_info", None, "WeightsInfoResponse"),
    Route("POST", "/api/v1/copy_weights", "CopyWeightsRequest", "CopyWeightsResponse"),
    Route("GET", "/api/v1/sessions", None, "ListSessionsResponse"),
    Route("GET", "/api/v1/sessions/{session_id}", None, "GetSessionResponse"),
    Route("POST", "/api/v1/sessions/search", "SessionSearchRequest", "SessionSearchResponse"),
    Route("PUT", "/api/v1/sessions/{session_id}/project", None, None),
    Route("GET", "/api/v1/sessions/{session_id}/trace_export", None, None),
    Route("GET", "/api/v1/audit", None, "AuditLogResponse"),
    Route("GET", "/api/v1/billing/usage/checkpoints/current", "GetCurrentCheckpointStorageUsageRequest",
          "CurrentCheckpointStorageUsageResponse"),
    Route("GET", "/api/v1/billing/usage/events", "GetBillingUsageRequest", "BillingUsageResponse"),
    Route("POST", "/api/v1/auth/token", None, "AuthTokenResponse"),
    Route("GET", "/api/v1/auth/apikey/me", None, None),
    Route("DELETE", "/api/v1/auth/apikey/me", None, None),
]

DOCUMENTED_ROUTES: list[Route] = [
    Route("POST", "/api/v1/external_weights_upload_start", "ExternalWeightsUploadStartRequest",
          "ExternalWeightsUploadStartResponse"),
    Route("PUT", "/api/v1/external_weights_upload/{upload_id}/{file}", None, None),
    Route("POST", "/api/v1/external_weights_upload_finish", "ExternalWeightsUploadFinishRequest",
          "ExternalWeightsUploadFinishResponse"),
    Route("POST", "/api/v1/checkpoints/search", "CheckpointSearchRequest", "CheckpointSearchResponse"),
]
"""Routes of an SDK release newer than the installed one, their types named in ``contract.documented`` (not pinned
from the installed SDK; the PUT is the signed URL that start hands out, this server's own)."""

FUTURE_STATES = ["TryAgainResponse", "RequestFailedResponse"]
"""JSON answers of retrieve_future besides the result itself."""
