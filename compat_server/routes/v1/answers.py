"""How every ``/v1`` route answers: a prepared completion, whole or streamed (cancelled when its client goes away),
and any error in OpenAI's shape. The Anthropic and Responses routes answer through the same code, re-shaped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import quote

from litestar import Request, Response
from litestar.exceptions import (
    HTTPException,
    NotAuthorizedException,
    SerializationException,
    ValidationException,
)
from litestar.response import Stream

from compat_server.access.quotas import TooManyRequests
from compat_server.completions.service import CompletionsService, Prepared
from compat_server.completions.stream import Translate, stream
from shims.errors import NotFound, UserError, too_deeply_nested
from shims.openai.errors import OpenAIError

log = logging.getLogger("compat_server.openai")


CLIENT_CLOSED = 499
"""nginx's status for a request whose client went away before the answer; it is never seen by that client."""


async def respond(request: Request, completions: CompletionsService, prepared: Prepared, ignored: list[str],
                  translate: Translate | None = None, shape: Callable[[dict], dict] | None = None) -> Response | Stream:
    """Answer a prepared chat or completion request, streamed or whole; another API's routes pass ``translate``
    (its stream events) and ``shape`` (its whole answer from the chat completion). Fields the request held that this
    server does not know are named in ``X-Ignored-Fields`` (they were ignored, as vLLM does)."""
    # percent-encoded: a field name is the client's text, and a header holds only visible ASCII
    headers = {"X-Ignored-Fields": ", ".join(quote(name, safe="") for name in ignored)} if ignored else {}
    if prepared.stream:  # Litestar stops a stream whose client went away, which cancels its sampling
        return Stream(stream(completions, prepared, translate), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    answer = await unless_disconnected(request, completions.complete(prepared))
    if answer is None:
        log.info("%s went away before its answer; its sampling was cancelled", prepared.id)
        return Response(None, status_code=CLIENT_CLOSED)
    return Response(shape(answer) if shape else answer, headers=headers)


async def unless_disconnected(request: Request, work: Awaitable[dict]) -> dict | None:
    """``work``'s result, or None after cancelling it if the client disconnects first (a timed-out SDK call, a
    closed app): the samplers then stop decoding for nobody, as vLLM's server does."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":  # the body is read: only a disconnect comes
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return task.result() if not task.cancelled() else None


def openai_error(_: Request, exc: Exception) -> Response:
    """Any error, answered in OpenAI's shape (the app sends every error on a ``/v1`` path here)."""
    headers = {}
    if isinstance(exc, OpenAIError):
        error = exc
    elif isinstance(exc, TooManyRequests):  # the openai client retries a 429 after its Retry-After
        error = OpenAIError(429, str(exc), code="rate_limit_exceeded", kind="requests")
        headers["Retry-After"] = f"{exc.retry_after:g}"
    elif isinstance(exc, NotFound):
        error = OpenAIError(404, str(exc), param="model", code="model_not_found")
    elif isinstance(exc, UserError):
        error = OpenAIError(400, str(exc))
    elif isinstance(exc, NotAuthorizedException):
        error = OpenAIError(401, exc.detail, code="invalid_api_key", kind="authentication_error")
    elif isinstance(exc, SerializationException):
        error = OpenAIError(400, f"the request body is not valid JSON: {exc}")
    elif isinstance(exc, ValidationException):
        error = OpenAIError(400, f"the request body is not valid JSON: {exc.detail}")
    elif isinstance(exc, HTTPException):
        error = OpenAIError(exc.status_code, exc.detail)
    elif (too_deep := too_deeply_nested(exc)) is not None:
        error = OpenAIError(400, str(too_deep))
    else:
        log.exception("unhandled error on an OpenAI route")
        error = OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}", kind="server_error")
    return Response(error.body(), status_code=error.status, headers=headers)


ERROR_CLASSES = (OpenAIError, NotFound, UserError, TooManyRequests, HTTPException, ValidationException,
                 SerializationException, Exception)
"""Every class the app maps to the Tinker shape: a router that names them all answers every error in its own shape."""
