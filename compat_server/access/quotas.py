"""Per-key request quota: how many requests each API key has unfinished, across the Tinker and OpenAI routes.

One counter per key, shared by both route families, so a client cannot get around ``--max-pending-per-key`` by
switching APIs, and one key flooding the server is refused before its work is queued while other keys carry on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class TooManyRequests(Exception):
    """A key already has its limit of unfinished requests; answered 429 with ``Retry-After``. Both SDKs honour it by
    retrying the same request later (the ``tinker`` client and the ``openai`` client alike)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KeyQuota:
    """Counts unfinished requests per key against ``limit`` (None: unlimited)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._pending: dict[str, int] = {}
        self._refused: dict[str, int] = {}

    def pending(self, owner: str) -> int:
        return self._pending.get(owner, 0)

    def usage(self, owner: str) -> dict:
        """What ``/api/v1/metrics`` shows a key about its own quota."""
        return {"pending": self.pending(owner), "limit": self.limit, "refused": self._refused.get(owner, 0)}

    def check(self, owner: str) -> None:
        """Raise ``TooManyRequests`` if ``owner`` is at the limit."""
        pending = self.pending(owner)
        if self.limit is not None and pending >= self.limit:
            self._refused[owner] = self._refused.get(owner, 0) + 1
            raise TooManyRequests(f"this key already has {pending} unfinished requests (--max-pending-per-key "
                                  f"{self.limit}); retry when some have finished")

    def acquire(self, owner: str, checked: bool = True) -> None:
        """Count one more unfinished request for ``owner``; at the limit, raise ``TooManyRequests`` (unless
        ``checked`` is False: for a request already admitted by ``check``)."""
        if checked:
            self.check(owner)
        self._pending[owner] = self.pending(owner) + 1

    def release(self, owner: str) -> None:
        left = self._pending.get(owner, 0) - 1
        if left > 0:
            self._pending[owner] = left
        else:
            self._pending.pop(owner, None)

    @contextmanager
    def hold(self, owner: str, checked: bool = True) -> Iterator[None]:
        """One request's share of the quota, for as long as the block runs."""
        self.acquire(owner, checked)
        try:
            yield
        finally:
            self.release(owner)
