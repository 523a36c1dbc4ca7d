"""OpenAI's Responses API, ``POST /v1/responses``: HTTP only. The request becomes a chat completion
(``shims.responses.wire``), sampled by the chat path, and its answer (whole, or streamed chunk by chunk) becomes a
response (``shims.responses.out``). Errors use OpenAI's shape, as on the other ``/v1`` routes."""

from __future__ import annotations

from litestar import Request, Response, Router, post
from litestar.di import NamedDependency
from litestar.response import Stream

from compat_server.routes.v1.answers import ERROR_CLASSES, openai_error, respond
from compat_server.services import Services
from shims.openai.errors import OpenAIError
from shims.responses.out import ResponseEvents, from_chat_completion
from shims.responses.wire import (
    chat_body,
    echoed_settings,
    ignored_fields,
    parse_responses_request,
    responses_error,
)


@post("/responses", status_code=200)
async def create_response(request: Request, owner: NamedDependency[str],
                          services: NamedDependency[Services]) -> Response | Stream:
    completions = services.completions
    req = parse_responses_request(await request.json())
    settings = echoed_settings(req)
    try:
        prepared = await completions.prepare(owner, chat_body(req), chat=True)
    except OpenAIError as exc:
        raise responses_error(exc) from None
    return await respond(request, completions, prepared, ignored_fields(req), ResponseEvents(settings).translate,
                         lambda answer: from_chat_completion(answer, settings))


RESPONSES_ROUTER = Router(
    path="/v1", route_handlers=[create_response],
    exception_handlers={cls: openai_error for cls in ERROR_CLASSES},
)
