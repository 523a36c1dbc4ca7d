"""Sampling routes: sampling sessions, the sampler record, and ``asample`` (which answers a future at once)."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.params import Body, FromPath
from tinker import types

from compat_server.services import Services
from compat_server.tinker.training import idempotency_key

API = "/api/v1"


@post(f"{API}/create_sampling_session", status_code=200)
async def create_sampling_session(owner: NamedDependency[str], services: NamedDependency[Services],
                                  data: Annotated[types.CreateSamplingSessionRequest, Body()]
                                  ) -> types.CreateSamplingSessionResponse:
    sampler_id = services.sampling.create_sampling_session(owner, data)
    return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)


@get(f"{API}/samplers/{{sampler_id:str}}")
async def get_sampler(sampler_id: FromPath[str], owner: NamedDependency[str],
                      services: NamedDependency[Services]) -> types.GetSamplerResponse:
    return services.sampling.get_sampler(owner, sampler_id)


@post(f"{API}/asample", status_code=200)
async def asample(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                  data: Annotated[types.SampleRequest, Body()]) -> dict:
    """Answers ``{request_id, sample_sequence_ids}``; the result is a protobuf ``SampleResponse``."""
    return services.sampling.asample(owner, data, idempotency_key(request))


@get(f"{API}/metrics")
async def metrics(owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    """Per base model: sampling counters, sampled tokens/s, the sampler replicas' load and resident adapters, the
    measured gap between sampler and trainer logprobs for the same tokens (rollout-vs-train drift), and how many
    training requests shared each trainer batch; and the calling key's own request count against
    ``--max-pending-per-key`` (unfinished now, and refused with 429 so far); and futures' latency percentiles over
    the server's most recent ones (submit to result, and each ``retrieve_future`` call)."""
    return {"sampling": await services.sampling.metrics(), "training": services.training.metrics(),
            "requests": services.quota.usage(owner), "futures": services.hub.latency()}


SAMPLING_ROUTES = [create_sampling_session, get_sampler, asample, metrics]
