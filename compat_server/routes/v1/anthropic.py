"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), for the unmodified ``anthropic`` SDK:
HTTP only. A request becomes an OpenAI chat body (``shims.anthropic.wire``) and samples through the same
``CompletionsService`` as the OpenAI routes; the answer, whole or streamed, is re-shaped (``shims.anthropic.out``).

Errors use Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, so the SDK raises its own typed
exceptions: 401 for a bad key, 404 for an unknown model, 400 for a bad parameter, 429 with ``Retry-After``.
"""

from __future__ import annotations

from litestar import Request, Response, Router, post
from litestar.di import NamedDependency
from litestar.response import Stream

from compat_server.routes.v1.answers import ERROR_CLASSES, openai_error, respond
from compat_server.services import Services
from shims.anthropic.out import MessageStream, error_body, message
from shims.anthropic.wire import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
    ignored_fields,
    parse_request,
    prompt_body,
)


@post("/messages", status_code=200)
async def create_message(request: Request, owner: NamedDependency[str],
                         services: NamedDependency[Services]) -> Response | Stream:
    req = parse_request(MessagesRequest, await request.json())
    completions = services.completions
    prepared = await completions.prepare(owner, chat_body(req), chat=True)
    stops = req.stop_sequences or []
    return await respond(request, completions, prepared, ignored_fields(req),
                         MessageStream(stops, prepared.prompt_tokens).translate, lambda answer: message(answer, stops))


@post("/messages/count_tokens", status_code=200)
async def count_tokens(request: Request, owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    """The rendered prompt's length: what ``usage.input_tokens`` of the same request will say."""
    req = parse_request(CountTokensRequest, await request.json())
    prepared = await services.completions.prepare(owner, prompt_body(req), chat=True)
    return {"input_tokens": prepared.prompt_tokens}


def anthropic_error(request: Request, exc: Exception) -> Response:
    """Any error, classified (status, message, ``Retry-After``) as on the OpenAI routes, answered in Anthropic's
    shape."""
    answer = openai_error(request, exc)
    return Response(error_body(answer.status_code, answer.content["error"]["message"]),
                    status_code=answer.status_code, headers=answer.headers)


ANTHROPIC_ROUTER = Router(
    path="/v1", route_handlers=[create_message, count_tokens],
    # Every class the app maps to the Tinker shape is named again here, so these routes answer in Anthropic's shape.
    exception_handlers={cls: anthropic_error for cls in ERROR_CLASSES},
)
