"""Calling Ray actors: errors come back as the server's own kinds, so callers never see Ray exception types."""

from __future__ import annotations

from ray.exceptions import RayActorError, RayTaskError

from shims.errors import UserError


class ActorUnavailable(RuntimeError):
    """An actor died, could not be reached, or failed with an unexpected error: a server-side failure."""


async def call_actor(actor, method: str, what: str, *args, **kwargs):
    """Await ``actor.method(*args)``; a ``UserError`` raised inside the actor is re-raised here as itself."""
    try:
        return await getattr(actor, method).remote(*args, **kwargs)
    except RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, UserError):
            raise UserError(str(cause)) from None
        raise ActorUnavailable(f"{what} failed in {method}: {cause}") from None
    except RayActorError as exc:
        raise ActorUnavailable(f"{what} is not available: {exc}") from None
