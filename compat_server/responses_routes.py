"""OpenAI's Responses API, ``POST /v1/responses``: HTTP only. The request becomes a chat completion
(``shims.responses_wire``), sampled by the chat path, and its answer (whole, or streamed chunk by chunk) becomes a
response (``shims.responses_out``). Errors use OpenAI's shape, as on the other ``/v1`` routes."""

from __future__ import annotations

import logging

from litestar import Request, Response, Router, post
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException, SerializationException, ValidationException
from litestar.response import Stream

from compat_server.completion_stream import stream
from compat_server.openai_routes import CLIENT_CLOSED, openai_error, unless_disconnected
from compat_server.quotas import TooManyRequests
from compat_server.services import Services
from shims.errors import NotFound, UserError
from shims.openai_errors import OpenAIError
from shims.responses_out import ResponseEvents, from_chat_completion
from shims.responses_wire import (
    chat_body,
    echoed_settings,
    ignored_fields,
    parse_responses_request,
    responses_error,
)

log = logging.getLogger("compat_server.openai")


@post("/responses", status_code=200)
async def create_response(request: Request, owner: NamedDependency[str],
                          services: NamedDependency[Services]) -> Response | Stream:
    completions = services.completions
    req = parse_responses_request(await request.json())
    settings = echoed_settings(req)
    try:
        prepared = completions.prepare(owner, chat_body(req), chat=True)
    except OpenAIError as exc:
        raise responses_error(exc) from None
    # vLLM's habit, as on the chat route: unknown fields are ignored, and the answer says which
    headers = {"X-Ignored-Fields": ", ".join(ignored)} if (ignored := ignored_fields(req)) else {}
    if prepared.stream:  # Litestar stops a stream whose client went away, which cancels its sampling
        return Stream(stream(completions, prepared, ResponseEvents(settings).translate),
                      media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    answer = await unless_disconnected(request, completions.complete(prepared))
    if answer is None:
        log.info("%s went away before its answer; its sampling was cancelled", prepared.id)
        return Response(None, status_code=CLIENT_CLOSED)
    return Response(from_chat_completion(answer, settings), headers=headers)


RESPONSES_ROUTER = Router(
    path="/v1", route_handlers=[create_response],
    exception_handlers={cls: openai_error for cls in (OpenAIError, NotFound, UserError, TooManyRequests,
                                                       HTTPException, ValidationException, SerializationException,
                                                       Exception)},
)
