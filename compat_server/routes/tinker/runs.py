"""REST routes of the SDK's ``RestClient``: training runs and checkpoints (its session routes are in sessions.py).
HTTP only."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from litestar import Request, delete, get, post, put
from litestar.di import NamedDependency
from litestar.params import Body, FromPath, FromQuery, Parameter
from litestar.response import File
from pydantic import BaseModel
from tinker import types

from compat_server.runs.downloads import DownloadGrant
from compat_server.runs.search import search_checkpoints
from compat_server.services import Services
from contract import documented

API = "/api/v1"
MAX_PAGE = 1000
# Page bounds are checked here, so a negative or huge value is a 400 naming it, not a database error.
Limit = Annotated[int, Parameter(ge=1, le=MAX_PAGE, description=f"items per page (1 to {MAX_PAGE})")]
Offset = Annotated[int, Parameter(ge=0, le=2**62, description="how many items to skip")]


class TtlBody(BaseModel):
    """``PUT …/ttl`` body (the SDK sends it as a plain dict; it has no type of its own)."""

    ttl_seconds: int | None = None


class WeightsInfoBody(BaseModel):
    tinker_path: str
CHECKPOINT = f"{API}/training_runs/{{run_id:str}}/checkpoints/{{kind:str}}/{{name:str}}"


@get(f"{API}/training_runs")
async def list_training_runs(owner: NamedDependency[str], services: NamedDependency[Services],
                             limit: Limit = 20, offset: Offset = 0) -> documented.TrainingRunsResponse:
    return services.runs.list_training_runs(owner, limit, offset)


@get(f"{API}/training_runs/{{run_id:str}}")
async def get_training_run(run_id: FromPath[str], owner: NamedDependency[str],
                           services: NamedDependency[Services]) -> documented.TrainingRun:
    return services.runs.get_training_run(owner, run_id)


@get(f"{API}/training_runs/{{run_id:str}}/checkpoints")
async def list_checkpoints(run_id: FromPath[str], owner: NamedDependency[str],
                           services: NamedDependency[Services]) -> documented.CheckpointsListResponse:
    return services.runs.list_checkpoints(owner, run_id)


@get(f"{API}/checkpoints")
async def list_user_checkpoints(owner: NamedDependency[str], services: NamedDependency[Services],
                                limit: Limit = 100, offset: Offset = 0) -> documented.CheckpointsListResponse:
    return services.runs.list_user_checkpoints(owner, limit, offset)


@post(f"{API}/checkpoints/search", status_code=200)
async def search_user_checkpoints(owner: NamedDependency[str], services: NamedDependency[Services],
                                  data: Annotated[documented.CheckpointSearchRequest, Body()],
                                  ) -> documented.CheckpointSearchResponse:
    """SDK 0.39's ``search_checkpoints`` (its route is not documented; ``contract.documented`` says why this one)."""
    return search_checkpoints(services.records, owner, data)


@delete(CHECKPOINT, status_code=200)
async def delete_checkpoint(run_id: FromPath[str], kind: FromPath[str], name: FromPath[str],
                            owner: NamedDependency[str], services: NamedDependency[Services]) -> None:
    services.runs.delete_checkpoint(owner, run_id, f"{kind}/{name}")


@post(f"{CHECKPOINT}/publish", status_code=200)
async def publish_checkpoint(run_id: FromPath[str], kind: FromPath[str], name: FromPath[str],
                             owner: NamedDependency[str], services: NamedDependency[Services]) -> None:
    services.runs.set_public(owner, run_id, f"{kind}/{name}", True)


@delete(f"{CHECKPOINT}/publish", status_code=200)
async def unpublish_checkpoint(run_id: FromPath[str], kind: FromPath[str], name: FromPath[str],
                               owner: NamedDependency[str], services: NamedDependency[Services]) -> None:
    services.runs.set_public(owner, run_id, f"{kind}/{name}", False)


@put(f"{CHECKPOINT}/ttl", status_code=200)
async def set_checkpoint_ttl(run_id: FromPath[str], kind: FromPath[str], name: FromPath[str],
                             owner: NamedDependency[str], services: NamedDependency[Services],
                             data: Annotated[TtlBody, Body()]) -> None:
    services.runs.set_ttl(owner, run_id, f"{kind}/{name}", data.ttl_seconds)


@post(f"{API}/weights_info", status_code=200)
async def weights_info(owner: NamedDependency[str], services: NamedDependency[Services],
                       data: Annotated[WeightsInfoBody, Body()]) -> types.WeightsInfoResponse:
    return services.runs.weights_info(owner, data.tinker_path)


@get(f"{CHECKPOINT}/external_weights_urls")
async def external_weights_urls(request: Request, run_id: FromPath[str], kind: FromPath[str], name: FromPath[str],
                                owner: NamedDependency[str],
                                services: NamedDependency[Services]) -> types.ExternalWeightsUrlsResponse:
    return services.runs.download_urls(owner, f"tinker://{run_id}/{kind}/{name}", str(request.base_url))


@get(f"{API}/download/{{run_id:str}}/{{kind:str}}/{{name:str}}/{{file:path}}", media_type="application/octet-stream")
async def download(run_id: FromPath[str], kind: FromPath[str], name: FromPath[str], file: FromPath[str],
                   expires: FromQuery[int], checkpoint: FromQuery[str], grantee: FromQuery[str],
                   signature: FromQuery[str], services: NamedDependency[Services]) -> File:
    """Needs no API key: the URL's signature is the permission, re-checked against the checkpoint as it is now."""
    relative = file.lstrip("/")
    grant = DownloadGrant(tinker_path=f"tinker://{run_id}/{kind}/{name}", uid=checkpoint, grantee=grantee)
    path = services.runs.download_file(grant, relative, expires, signature)
    return File(path, filename=Path(relative).name)


@post(f"{API}/copy_weights", status_code=200)
async def copy_weights(owner: NamedDependency[str], services: NamedDependency[Services],
                       data: Annotated[types.CopyWeightsRequest, Body()]) -> types.CopyWeightsResponse:
    return services.runs.copy_weights(owner, data)


RUNS_ROUTES = [list_training_runs, get_training_run, list_checkpoints, list_user_checkpoints, search_user_checkpoints,
               delete_checkpoint,
               publish_checkpoint, unpublish_checkpoint, set_checkpoint_ttl, weights_info, external_weights_urls,
               download, copy_weights]
