"""Sampling routes: sampling sessions, the sampler record, and ``asample`` (which answers a future at once)."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.params import Body, FromPath
from tinker import types

from compat_server.routes.tinker.training import idempotency_key
from compat_server.services import Services
from shims.errors import NotFound

API = "/api/v1"


@post(f"{API}/create_sampling_session", status_code=200)
async def create_sampling_session(owner: NamedDependency[str], services: NamedDependency[Services],
                                  data: Annotated[types.CreateSamplingSessionRequest, Body()]
                                  ) -> types.CreateSamplingSessionResponse:
    sampler_id = services.sampling.sessions.create(owner, data)
    return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)


@get(f"{API}/samplers/{{sampler_id:str}}")
async def get_sampler(sampler_id: FromPath[str], owner: NamedDependency[str],
                      services: NamedDependency[Services]) -> types.GetSamplerResponse:
    return services.sampling.sessions.get(owner, sampler_id)


@post(f"{API}/join_sampling_session", status_code=200)
async def join_sampling_session(owner: NamedDependency[str], services: NamedDependency[Services],
                                data: Annotated[types.JoinSamplingSessionRequest, Body()]
                                ) -> types.JoinSamplingSessionResponse:
    """An unpickled sampling client asks for its clone number, so clones never share a block of ``seq_id``s."""
    counter = services.records.samplers.join_sampler(data.sampling_session_id, owner)
    if counter is None:
        raise NotFound(f"unknown sampling session {data.sampling_session_id!r}")
    return types.JoinSamplingSessionResponse(client_counter=counter)


@post(f"{API}/asample", status_code=200)
async def asample(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                  data: Annotated[types.SampleRequest, Body()]) -> dict:
    """Answers ``{request_id, sample_sequence_ids}``; the result is a protobuf ``SampleResponse``."""
    return services.sampling.asample(owner, data, idempotency_key(request))


@get(f"{API}/metrics")
async def metrics(owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    """The caller's own figures: per base model, its sampling counters, sampled tokens/s and the logprob drift
    measured on its requests (sampler vs trainer for the same tokens); its request count against
    ``--max-pending-per-key`` (unfinished now, refused with 429 so far); and its futures' latency percentiles.

    An operator key (``compat-server keys create --admin``) sees the server's figures instead: every tenant's
    counts together, the sampler replicas' load and resident adapters, how many training requests shared each
    trainer batch, and all futures' latencies. The same server-wide figures go to the OpenTelemetry export."""
    scope = None if services.records.tenants.is_admin(owner) else owner
    answer = {"scope": "server" if scope is None else "key", "sampling": await services.sampling.metrics(scope),
              "requests": services.quota.usage(owner), "futures": services.hub.latency(scope)}
    if scope is None:
        answer["training"] = services.training.metrics()
    return answer


SAMPLING_ROUTES = [create_sampling_session, get_sampler, join_sampling_session, asample, metrics]
