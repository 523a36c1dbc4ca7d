"""Calling Ray actors through their component's Protocol (``adapters.boundary``): a typed proxy whose attributes are
the Protocol's methods, and errors that come back as the server's own kinds, so callers never see Ray exception
types."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar, cast

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from adapters.boundary import Method, methods
from adapters.disk import DiskFull
from adapters.samplers.interface import Restarting
from shims.errors import ConfigurationRefused, UserError

log = logging.getLogger("compat_server.actors")

T = TypeVar("T")


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


async def await_call(ref, what: str, method: str, cancel: bool = True):
    """Await an actor call already submitted (``ref``), its errors translated (``_translated``). ``cancel``: a caller
    that stops waiting cancels the call (not where several actors must all run the same calls: the shards of one
    trainer, ``adapters.trainer.group``)."""
    try:
        with _translated(what, method):
            return await ref
    except asyncio.CancelledError:
        if cancel:
            _cancel(ref)
        raise


async def _stream(submit: Callable[[], Any], what: str, method: str) -> AsyncIterator:
    """Start a streaming actor method (``submit``: its ``ObjectRefGenerator``) once the consumer asks for its first
    item, then iterate what it yields, each item as soon as it is yielded. A consumer that stops early cancels the
    actor's generator (Ray would otherwise run it to its end)."""
    refs = submit()
    try:
        with _translated(what, method):
            async for ref in refs:
                yield await ref
    except (GeneratorExit, asyncio.CancelledError):
        _cancel(refs)
        raise


class _Proxy:
    """Calls to a component through its Protocol (``adapters.boundary``): an attribute for each Protocol method,
    made once, each sending its calls the one way the proxy was made with."""

    def __init__(self, protocol: Any, bind: Callable[[Method], Callable[..., Any]], what: str) -> None:
        self._what = what
        for method in methods(protocol).values():
            self.__dict__[method.name] = bind(method)

    def __repr__(self) -> str:
        return f"<{self._what}>"


def actor_proxy(handle: Any, protocol: Callable[..., T], what: str, cancel: bool = True) -> T:
    """The actor behind the Ray ``handle``, called as ``protocol`` says: ``await proxy.sample(adapter, job)``, ``async
    for item in proxy.stream(adapter, job)``, each call's errors translated (``_translated``; ``what`` names the actor
    in them). A caller that stops waiting cancels the actor task too (``cancel``, not for an actor that must run every
    call it was sent: a trainer shard): queued, it never runs; running in an async actor, it is cancelled there (a
    sampler drops the request). (``protocol`` is the Protocol class, typed as a callable making a ``T`` because mypy
    refuses a Protocol where a ``type[T]`` is expected; the type checker then sees ``T``'s methods on the proxy.)"""

    def bind(method: Method) -> Callable[..., Any]:
        if method.streams:
            return lambda *args, **kwargs: _stream(lambda: method.submit(handle, args, kwargs), what, method.name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            refs = method.submit(handle, args, kwargs)
            if method.by_reference:  # the receipt awaited, the value's reference handed back unread
                return await await_call(refs[0], what, method.name, cancel), refs[1]
            return await await_call(refs, what, method.name, cancel)
        return call

    return cast(T, _Proxy(protocol, bind, what))


Around = Callable[[Method, tuple, dict], AbstractContextManager[Any]]
"""What wraps each call a proxy sends (``Method``, its arguments): the server's tracing span."""


def proxy(protocol: Callable[..., T], send: Callable[[Method, tuple, dict], Awaitable[Any]], what: str,
          around: Around | None = None) -> T:
    """A component made of several actors (the shards of one trainer), called as ``protocol`` says: each call goes to
    ``send`` with its method and arguments, inside ``around`` if given."""

    def bind(method: Method) -> Callable[..., Awaitable[Any]]:
        if around is None:
            return lambda *args, **kwargs: send(method, args, kwargs)

        async def call(*args: Any, **kwargs: Any) -> Any:
            with around(method, args, kwargs):
                return await send(method, args, kwargs)
        return call

    return cast(T, _Proxy(protocol, bind, what))
