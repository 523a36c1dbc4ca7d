"""The dashboard: ``GET /`` serves the page; the page asks for the viewer's API key and reads ``GET /api/v1/dashboard``
with it every few seconds. HTTP only; the view is assembled in ``dashboard.py``."""

from __future__ import annotations

from pathlib import Path

from litestar import MediaType, Response, get
from litestar.di import NamedDependency

from compat_server.account.dashboard import dashboard
from compat_server.services import Services

PAGE = Path(__file__).parent.parent / "static" / "dashboard.html"


@get("/", media_type=MediaType.HTML, include_in_schema=False)
async def dashboard_page() -> Response:
    """No key is needed for the page itself; every figure on it is fetched with the key the viewer enters."""
    return Response(PAGE.read_bytes(), media_type=MediaType.HTML, headers={"Cache-Control": "no-cache"})


@get("/api/v1/dashboard")
async def dashboard_data(owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    """Sessions, training runs with per-step losses, checkpoints, sampler pool and recent errors of the caller's key."""
    return await dashboard(services.records, services.sampling, owner)


DASHBOARD_ROUTES = [dashboard_page, dashboard_data]
