"""Why a request is waiting for compute, told to whoever shows it to the client (the futures' ``queue_state`` on
``retrieve_future``, as hosted Tinker's ``try_again`` answers carry it). The server sets a listener for the request
whose work runs in the current task (``listener``, a context variable); the trainer and sampler pools say where the
request waits (``waiting``) and when its work starts (``running``), without knowing which request it is."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

WaitListener = Callable[[str | None], None]
"""Called with the reason the request waits, or None once its work runs."""

listener: ContextVar[WaitListener | None] = ContextVar("wait_listener", default=None)
"""The listener of the request whose work the current task does (None: nobody is listening)."""


def waiting(reason: str) -> WaitListener | None:
    """Say that the current request waits, and why; returns its listener, for whoever starts its work later (from
    another task: ``running(listener)``)."""
    told = listener.get()
    if told is not None:
        told(reason)
    return told


def running(told: WaitListener | None) -> None:
    """Say that the request ``told`` belongs to runs now."""
    if told is not None:
        told(None)
