"""Calling Ray actors: errors come back as the server's own kinds, so callers never see Ray exception types."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from adapters.disk import DiskFull
from adapters.samplers.interface import Restarting
from shims.errors import ConfigurationRefused, UserError

log = logging.getLogger("compat_server.actors")


def ray_node() -> str:
    """The Ray node this process runs on ("" outside Ray), for placement reports."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


class ActorUnavailable(RuntimeError):
    """An actor died, could not be reached, or failed with an unexpected error: a server-side failure."""


class ActorCallFailed(RuntimeError):
    """A call raised an unexpected error inside an actor that is still alive: a server-side failure of that call
    only."""


class ActorRestarting(ActorUnavailable):
    """The actor is being restarted: a call made now was refused without running, and one made once the actor is
    back will run."""


@contextmanager
def _translated(what: str, method: str) -> Iterator[None]:
    """A ``UserError`` or ``DiskFull`` raised inside the actor is re-raised as itself, anything else it raises as
    ``ActorCallFailed``; a dead or unreachable actor is ``ActorUnavailable`` (``ActorRestarting`` while Ray brings
    it back)."""
    try:
        yield
    except RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, UserError):
            raise UserError(str(cause)) from None
        if isinstance(cause, ConfigurationRefused):
            raise ConfigurationRefused(str(cause)) from None
        if isinstance(cause, DiskFull):  # the actor is fine; the disk is not
            raise DiskFull(str(cause)) from None
        if isinstance(cause, Restarting):
            raise ActorRestarting(f"{what} is restarting: {cause}") from None
        raise ActorCallFailed(f"{what} failed in {method}: {cause}") from None
    except ActorUnavailableError as exc:
        raise ActorRestarting(f"{what} is restarting: {exc}") from None
    except RayActorError as exc:
        raise ActorUnavailable(f"{what} is not available: {exc}") from None


def _cancel(ref) -> None:
    """Ask Ray to cancel ``ref``'s task; best effort, so that a Ray already shut down (the server stopping) never
    turns a caller's cancellation into a failure of its own."""
    try:
        ray.cancel(ref)
    except Exception as exc:  # noqa: BLE001 - whatever Ray says, the caller's CancelledError goes on
        log.debug("could not cancel a Ray task: %s", exc)


async def call_actor(actor, method: str, what: str, *args, **kwargs):
    """Await ``actor.method(*args)``. A caller that stops waiting (its task cancelled) cancels the actor task too:
    queued, it never runs; running in an async actor, it is cancelled there (a sampler drops the request)."""
    return await await_call(getattr(actor, method).remote(*args, **kwargs), what, method)


async def await_call(ref, what: str, method: str, cancel: bool = True):
    """Await an actor call already submitted (``ref``), its errors translated as ``call_actor``'s. ``cancel``: a
    caller that stops waiting cancels the call (not where several actors must all run the same calls: the shards of
    one trainer, ``adapters.trainer.group``)."""
    try:
        with _translated(what, method):
            return await ref
    except asyncio.CancelledError:
        if cancel:
            _cancel(ref)
        raise


async def stream_actor(actor, method: str, what: str, *args) -> AsyncIterator:
    """Iterate what the async-generator method ``actor.method(*args)`` yields, each item as soon as it is yielded.
    A consumer that stops early cancels the actor's generator (Ray would otherwise run it to its end)."""
    generator = getattr(actor, method).options(num_returns="streaming").remote(*args)
    try:
        with _translated(what, method):
            async for ref in generator:
                yield await ref
    except (GeneratorExit, asyncio.CancelledError):
        _cancel(generator)
        raise
