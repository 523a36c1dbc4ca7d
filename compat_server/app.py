"""Builds the Litestar app and owns the lifetime of Ray, the pools and the records."""

from __future__ import annotations

import logging
import os

import ray
from litestar import Litestar, Request, Response
from litestar.di import Provide
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from compat_server import telemetry
from compat_server.access.auth import provide_owner
from compat_server.access.quotas import TooManyRequests
from compat_server.config import ServerConfig
from compat_server.routes.dashboard import DASHBOARD_ROUTES
from compat_server.routes.serving import SERVING_ROUTER
from compat_server.routes.tinker import ROUTES as TINKER_ROUTES
from compat_server.routes.v1.answers import openai_error
from compat_server.routes.v1.anthropic import anthropic_error
from compat_server.routes.v1.mounts import ANTHROPIC_PREFIXES, OPENAI_PREFIXES
from compat_server.routes.v1.mounts import ROUTERS as OPENAI_ANTHROPIC_ROUTERS
from compat_server.services import Services, start_services
from shims.errors import NotFound, UserError, too_deeply_nested

log = logging.getLogger("compat_server")


def _error(status: int, message: str, category: str = "user") -> Response:
    return Response({"error": message, "category": category, "detail": message}, status_code=status)


def _user_error(_: Request, exc: UserError) -> Response:
    return _error(400, str(exc))


def _too_many(_: Request, exc: TooManyRequests) -> Response:
    response = _error(429, str(exc))
    response.headers["Retry-After"] = f"{exc.retry_after:g}"
    return response


def _not_found(_: Request, exc: NotFound) -> Response:
    return _error(404, str(exc))


def _validation_error(_: Request, exc: ValidationException) -> Response:
    problems = "; ".join(f"{e.get('key', '?')}: {e.get('message', '')}" for e in (exc.extra or []) if isinstance(e, dict))
    return _error(400, f"{exc.detail}{': ' + problems if problems else ''}")


def _bad_json(_: Request, exc: SerializationException) -> Response:
    return _error(400, f"the request body is not valid JSON: {exc}")


def _http_error(request: Request, exc: HTTPException) -> Response:
    path = request.url.path  # e.g. an unknown path, a wrong method: answered in the shape its SDK reads
    if any(path == prefix or path.startswith(f"{prefix}/") for prefix in ANTHROPIC_PREFIXES):
        return anthropic_error(request, exc)
    if any(path == prefix or path.startswith(f"{prefix}/") for prefix in OPENAI_PREFIXES):
        return openai_error(request, exc)
    response = _error(exc.status_code, exc.detail, "user" if exc.status_code < 500 else "server")
    response.headers.update(exc.headers or {})  # e.g. WWW-Authenticate on an expired SDK token
    return response


def _server_error(request: Request, exc: Exception) -> Response:
    if (too_deep := too_deeply_nested(exc)) is not None:
        return _user_error(request, too_deep)
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error(500, f"internal server error: {type(exc).__name__}: {exc}", "server")


def create_app(config: ServerConfig, services: Services | None = None) -> Litestar:
    """The app over ``services`` (``compat_server.cli`` starts them first, so that a configuration they refuse ends
    the server with its message alone); without them, started when the app starts."""

    async def startup(app: Litestar) -> None:
        app.state.services = services or await start_services(config)

    async def shutdown(app: Litestar) -> None:
        services: Services | None = getattr(app.state, "services", None)
        if services is not None:
            # Named saves whose files are still being written: their clients wait for them (a minute at most).
            unfinished = await services.scheduler.finish_pending(timeout=60.0)
            if unfinished:
                log.warning("stopping with %d named saves still being written: their futures stay unanswered, and "
                            "they are not listed", unfinished)
            services.stop()
        if ray.is_initialized() and not os.environ.get("COMPAT_SERVER_KEEP_RAY"):
            ray.shutdown()

    def provide_services(request: Request) -> Services:
        return request.app.state.services

    plugins = [telemetry.litestar_plugin()] if telemetry.setup(config.otlp_endpoint) else []
    return Litestar(
        route_handlers=[*TINKER_ROUTES, *OPENAI_ANTHROPIC_ROUTERS, SERVING_ROUTER,
                        *DASHBOARD_ROUTES],
        plugins=plugins,
        on_startup=[startup],
        on_shutdown=[shutdown],
        dependencies={"services": Provide(provide_services, sync_to_thread=False), "owner": Provide(provide_owner)},
        exception_handlers={
            UserError: _user_error, NotFound: _not_found, TooManyRequests: _too_many,
            ValidationException: _validation_error, SerializationException: _bad_json, HTTPException: _http_error,
            Exception: _server_error,
        },
        request_max_body_size=config.max_body_mb * 1024 * 1024,
        debug=False,
        logging_config=None,  # the CLI configures logging once, for the whole process
    )
