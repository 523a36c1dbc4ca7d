"""OpenAI-compatible routes (``/v1/...``): HTTP parsing and answering only; the work is in
``compat_server.completions``, the answers and the error shape in ``answers.py``.

Errors on these routes use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so the ``openai``
SDK raises its own typed exceptions: 401 for a bad key, 404 for an unknown model, 400 for a bad parameter.
"""

from __future__ import annotations

import re

from litestar import Request, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Stream

from compat_server.routes.v1.answers import ERROR_CLASSES, openai_error, respond
from compat_server.services import Services

COLLAPSED_SCHEME = re.compile(r"(^|;)tinker:/(?!/)")


async def _answer(request: Request, services: Services, owner: str, chat: bool) -> Response | Stream:
    prepared = await services.completions.prepare(owner, await request.json(), chat)
    return await respond(request, services.completions, prepared, prepared.ignored)


@post("/chat/completions", status_code=200)
async def chat_completions(request: Request, owner: NamedDependency[str],
                           services: NamedDependency[Services]) -> Response | Stream:
    return await _answer(request, services, owner, chat=True)


@post("/completions", status_code=200)
async def completions(request: Request, owner: NamedDependency[str],
                      services: NamedDependency[Services]) -> Response | Stream:
    return await _answer(request, services, owner, chat=False)


@get("/models")
async def list_models(owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    return services.completions.list_models(owner)


@get("/models/{model:path}")
async def retrieve_model(model: FromPath[str], owner: NamedDependency[str],
                         services: NamedDependency[Services]) -> dict:
    # URL paths collapse a double slash, even sent as %2F%2F: tinker:// again, alone or after "<base>;"
    model = COLLAPSED_SCHEME.sub(r"\1tinker://", model.lstrip("/"))
    return services.completions.retrieve_model(owner, model)


OPENAI_ROUTER = Router(
    path="/v1", route_handlers=[chat_completions, completions, list_models, retrieve_model],
    # Every class the app maps to the Tinker shape is named again here, so these routes answer in OpenAI's shape.
    exception_handlers={cls: openai_error for cls in ERROR_CLASSES},
)
