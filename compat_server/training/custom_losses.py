"""Custom losses created with ``create_custom_loss``: kept per session, looked up by ``forward_backward``.

As the SDK documents (``CreateCustomLossResponse.loss_id``: "names the stored loss in forward_backward requests of the
same session"), a loss id works only for the key and the session that created it; that is checked at every use, and
a loss of another key is answered exactly like an unknown one. The losses live in the server's memory: they go when
their session finishes or expires, and a restarted server has none (the SDK creates each once per session, so a
client that outlives a server restart gets a clear error naming the loss id).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from shims.custom_loss.graph import CustomLoss
from shims.errors import UserError

log = logging.getLogger("compat_server.training")


def loss_id_for(session_id: str, custom_loss_seq_id: int) -> str:
    """Like model ids (``SESSION:train:N``): the session's own numbering, so a retried create finds its loss."""
    return f"{session_id}:custom_loss:{custom_loss_seq_id}"


@dataclass(frozen=True)
class _Stored:
    owner: str
    session_id: str
    loss: CustomLoss
    digest: str
    """Of the request that created it: a retry of that request gets the same id."""


class CustomLossStore:
    """Every session's custom losses, by loss id, at most ``max_per_key`` per API key."""

    def __init__(self) -> None:
        self._losses: dict[str, _Stored] = {}

    def add(self, owner: str, session_id: str, custom_loss_seq_id: int, loss: CustomLoss, digest: str,
            max_per_key: int) -> str:
        """Store ``loss`` and return its id. The same request again (a retry) returns the same id."""
        if not 0 <= custom_loss_seq_id < 2**63:
            raise UserError(f"custom_loss_seq_id must be a number from 0 to 2**63 - 1, got {custom_loss_seq_id}")
        loss_id = loss_id_for(session_id, custom_loss_seq_id)
        existing = self._losses.get(loss_id)
        if existing is not None:
            if existing.owner == owner and existing.digest == digest:
                return loss_id
            raise UserError(f"custom_loss_seq_id {custom_loss_seq_id} of session {session_id} already names another "
                            "custom loss; number each loss of a session once")
        held = sum(1 for stored in self._losses.values() if stored.owner == owner)
        if held >= max_per_key:
            raise UserError(f"this key already holds {held} custom losses (--max-custom-losses-per-key "
                            f"{max_per_key}); they are released when their session ends")
        self._losses[loss_id] = _Stored(owner, session_id, loss, digest)
        log.info("custom loss created: %s (%s, %d steps)", loss_id, loss.name, len(loss.steps),
                 extra={"event": "custom_loss_created", "loss_id": loss_id, "loss_name": loss.name,
                        "steps": len(loss.steps)})
        return loss_id

    def resolve(self, owner: str, session_id: str, config: Mapping[str, float | str]) -> CustomLoss:
        """The loss a ``forward_backward(..., "custom", {"loss_id": …})`` names, for a model of ``session_id``."""
        if set(config) != {"loss_id"} or not isinstance(config["loss_id"], str):
            raise UserError(f"loss_fn 'custom' takes exactly one loss_fn_config key, loss_id (a string from "
                            f"create_custom_loss); got keys {sorted(config)}")
        loss_id = config["loss_id"]
        stored = self._losses.get(loss_id)
        if stored is None or stored.owner != owner:
            raise UserError(f"unknown loss_id {loss_id[:200]!r}: create the loss with create_custom_loss in this "
                            "session (losses are kept per session, and not across server restarts)")
        if stored.session_id != session_id:
            raise UserError(f"custom loss {loss_id} belongs to session {stored.session_id}; it can only be used by "
                            f"training clients of that session, and this model is of session {session_id}")
        return stored.loss

    def drop_session(self, session_id: str) -> int:
        """Forget a finished or expired session's losses; returns how many there were."""
        gone = [loss_id for loss_id, stored in self._losses.items() if stored.session_id == session_id]
        for loss_id in gone:
            del self._losses[loss_id]
        return len(gone)
