"""Futures: ``retrieve_future`` (one future, long-polled), ``retrieve_futures`` (every future of a sampling client in
one long poll) and ``cancel_future`` (stop an abandoned sample)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Response, post
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException
from litestar.params import Body
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from compat_server.jobs.futures import poll_group
from compat_server.services import Services
from shims.errors import UserError

MAX_COMPLETIONS_PER_POLL = 1_000
"""A poll answers at most this many completions; the cursor brings the rest on the next one."""


@post("/api/v1/retrieve_future", status_code=200)
async def retrieve_future(owner: NamedDependency[str], services: NamedDependency[Services],
                          data: Annotated[types.FutureRetrieveRequest, Body()]) -> Response:
    """The SDK re-polls at once on ``try_again``, so the server holds each poll open for a few seconds first. A
    ``try_again`` says whether the request is queued or running (``active``) or waits for compute that other
    requests hold (``paused_capacity``, with the reason, which the SDK logs after a long pause), as hosted Tinker's
    do."""
    row = await services.hub.wait(data.request_id, owner, services.config.poll_hold_seconds)
    if row is None:
        raise NotFoundException(f"unknown request_id {data.request_id!r}")
    if row["state"] == "pending":
        reason = services.hub.wait_reason(data.request_id)
        answer = TryAgainResponse(request_id=data.request_id, queue_state="paused_capacity" if reason else "active")
        return Response({**answer.model_dump(), "queue_state_reason": reason})
    if row["state"] == "failed":
        return Response(types.RequestFailedResponse(error=row["error"], category=row["category"]).model_dump(
            mode="json"))
    return Response(row["result"], media_type=row["media_type"])


@post("/api/v1/retrieve_futures", status_code=200)
async def retrieve_futures(owner: NamedDependency[str], services: NamedDependency[Services],
                           data: Annotated[types.FuturesRetrieveRequest, Body()]) -> types.FuturesRetrieveResponse:
    """Which of a sampling client's requests finished since ``prev_cursor`` (the SDK then fetches each result with
    ``retrieve_future``). Held open like ``retrieve_future`` while none has; ``timeout`` shortens the hold (0 answers
    at once). Payloads the client reports retrieved are dropped from the records."""
    target = data.target
    if target.cloned_sampler_id < 0 or data.prev_cursor < 0:
        raise UserError("cloned_sampler_id and prev_cursor must not be negative")
    if services.records.samplers.sampler(target.sampling_session_id, owner) is None:
        raise NotFoundException(f"unknown sampling session {target.sampling_session_id!r}")
    group = poll_group(target.sampling_session_id, target.cloned_sampler_id * 1_000_000_000)
    if data.retrieved_request_ids:
        services.records.futures.forget_results(owner, group, data.retrieved_request_ids[:MAX_COMPLETIONS_PER_POLL])
    hold = services.config.poll_hold_seconds if data.timeout is None else max(0.0, min(
        data.timeout, services.config.poll_hold_seconds))
    finished = await services.hub.wait_group(owner, group, data.prev_cursor, hold, MAX_COMPLETIONS_PER_POLL)
    completions: list[Any] = [
        types.FutureFinished(request_id=row["request_id"], response_payload_uncompressed_size=row["size"])
        if row["state"] == "complete" else types.FutureFailed(request_id=row["request_id"]) for row in finished]
    cursor = finished[-1]["completion_seq"] if finished else data.prev_cursor
    return types.FuturesRetrieveResponse(completions=completions, cursor=cursor)


@post("/api/v1/cancel_future", status_code=200)
async def cancel_future(owner: NamedDependency[str], services: NamedDependency[Services],
                        data: Annotated[dict[str, Any], Body()]) -> None:
    """A sample the client abandoned (a timeout or a local cancel, with ``sample_cancel_enabled``) stops using the
    sampler; its future then answers that it was cancelled. A finished request is left as it is."""
    request_id = data.get("request_id")
    if not isinstance(request_id, str):
        raise UserError("cancel_future needs {\"request_id\": \"…\"}")
    row = services.records.futures.future(request_id, owner)
    if row is None:
        raise NotFoundException(f"unknown request_id {request_id!r}")
    if row["kind"] == "sample":
        services.scheduler.cancel(request_id)


FUTURES_ROUTES = [retrieve_future, retrieve_futures, cancel_future]
