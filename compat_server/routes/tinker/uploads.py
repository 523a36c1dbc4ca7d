"""Adapter upload routes (SDK 0.39, experimental): start, the signed PUT of each file, finish. HTTP only: the work is
in ``compat_server.runs.uploads``."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, post, put
from litestar.di import NamedDependency
from litestar.params import Body, FromPath, FromQuery

from compat_server.services import Services
from contract import documented

API = "/api/v1"


@post(f"{API}/external_weights_upload_start", status_code=200)
async def external_weights_upload_start(
        request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
        data: Annotated[documented.ExternalWeightsUploadStartRequest, Body()],
) -> documented.ExternalWeightsUploadStartResponse | documented.ExternalWeightsUploadStartResponseV039:
    return services.uploads.start(owner, data, str(request.base_url),
                                  request.headers.get("x-stainless-package-version"))


@put(f"{API}/external_weights_upload/{{upload_id:str}}/{{file:str}}", status_code=200, request_max_body_size=None)
async def external_weights_upload_file(request: Request, upload_id: FromPath[str], file: FromPath[str],
                                       expires: FromQuery[int], grantee: FromQuery[str], signature: FromQuery[str],
                                       services: NamedDependency[Services]) -> None:
    """Needs no API key: the URL's signature is the permission, re-checked against the upload as it is now. The
    body is streamed to disk, bounded as it comes (``request_max_body_size`` is the upload's own bound)."""
    length = request.headers.get("content-length")
    await services.uploads.receive(upload_id, file, expires, grantee, signature,
                                   int(length) if length and length.isdigit() else None, request.stream())


@post(f"{API}/external_weights_upload_finish", status_code=200)
async def external_weights_upload_finish(
        owner: NamedDependency[str], services: NamedDependency[Services],
        data: Annotated[documented.ExternalWeightsUploadFinishRequest, Body()],
) -> documented.ExternalWeightsUploadFinishResponse:
    return await services.uploads.finish(owner, data.upload_id)


UPLOAD_ROUTES = [external_weights_upload_start, external_weights_upload_file, external_weights_upload_finish]
