"""``retrieve_future``: long-polls a future, then answers its result, its error, or ``try_again``."""

from __future__ import annotations

from typing import Annotated

from litestar import Response, post
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException
from litestar.params import Body
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from compat_server.services import Services


@post("/api/v1/retrieve_future", status_code=200)
async def retrieve_future(owner: NamedDependency[str], services: NamedDependency[Services],
                          data: Annotated[types.FutureRetrieveRequest, Body()]) -> Response:
    """The SDK re-polls at once on ``try_again``, so the server holds each poll open for a few seconds first."""
    row = await services.hub.wait(data.request_id, owner, services.config.poll_hold_seconds)
    if row is None:
        raise NotFoundException(f"unknown request_id {data.request_id!r}")
    if row["state"] == "pending":
        return Response(TryAgainResponse(request_id=data.request_id, queue_state="active").model_dump())
    if row["state"] == "failed":
        return Response(types.RequestFailedResponse(error=row["error"], category=row["category"]).model_dump(
            mode="json"))
    return Response(row["result"], media_type=row["media_type"])
