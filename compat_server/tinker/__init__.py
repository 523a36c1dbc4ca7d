"""Tinker API routes (``/api/v1/...``): HTTP parsing and answering only; the work lives in the services."""

from compat_server.tinker.account import ACCOUNT_ROUTES
from compat_server.tinker.futures import FUTURES_ROUTES
from compat_server.tinker.runs import RUNS_ROUTES
from compat_server.tinker.sampling import SAMPLING_ROUTES
from compat_server.tinker.service import SERVICE_ROUTES
from compat_server.tinker.training import TRAINING_ROUTES

ROUTES = [*SERVICE_ROUTES, *TRAINING_ROUTES, *SAMPLING_ROUTES, *RUNS_ROUTES, *FUTURES_ROUTES, *ACCOUNT_ROUTES]
