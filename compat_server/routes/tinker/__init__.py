"""Tinker API routes (``/api/v1/...``): HTTP parsing and answering only; the work lives in the services."""

from compat_server.routes.tinker.account import ACCOUNT_ROUTES
from compat_server.routes.tinker.futures import FUTURES_ROUTES
from compat_server.routes.tinker.runs import RUNS_ROUTES
from compat_server.routes.tinker.sampling import SAMPLING_ROUTES
from compat_server.routes.tinker.sessions import SESSION_ROUTES
from compat_server.routes.tinker.training import TRAINING_ROUTES
from compat_server.routes.tinker.uploads import UPLOAD_ROUTES

ROUTES = [*SESSION_ROUTES, *TRAINING_ROUTES, *SAMPLING_ROUTES, *RUNS_ROUTES, *UPLOAD_ROUTES, *FUTURES_ROUTES,
          *ACCOUNT_ROUTES]
