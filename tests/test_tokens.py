"""The SDK token issuer: a token is checked at every use, although its signature is verified once."""

from __future__ import annotations

import time

import pytest

from compat_server.access import tokens
from compat_server.access.tokens import TokenIssuer


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock(time.time() - 30)  # in the past, so that PyJWT (on the real clock) takes every token's ``iat``
    monkeypatch.setattr(tokens.time, "time", clock.time)
    return clock


def test_a_token_stops_working_at_its_expiry_even_after_it_was_accepted(clock):
    issuer = TokenIssuer(b"k" * 32, ttl_seconds=600)
    token = issuer.issue("tenant-a", "alice")
    assert issuer.tenant(token) == "tenant-a"
    clock.now = int(clock.now) + 599
    assert issuer.tenant(token) == "tenant-a"
    clock.now += 1
    assert issuer.tenant(token) is None
    assert issuer.tenant(token) is None


def test_a_forged_or_foreign_token_is_refused(clock):
    issuer, other = TokenIssuer(b"k" * 32, 600), TokenIssuer(b"o" * 32, 600)
    token = issuer.issue("tenant-a", "alice")
    assert issuer.tenant(token) == "tenant-a"
    header, claims, signature = token.split(".")
    assert issuer.tenant(f"{header}.{claims}.{signature[:-2]}AA") is None
    assert issuer.tenant(other.issue("tenant-a", "alice")) is None
    assert issuer.tenant("not-a-token") is None


def test_the_kept_verifications_are_bounded(clock, monkeypatch):
    monkeypatch.setattr(tokens, "VERIFIED_KEPT", 3)
    issuer = TokenIssuer(b"k" * 32, 600)
    issued = []
    for index in range(5):
        issued.append(issuer.issue(f"tenant-{index}", "x"))
        clock.now += 1  # a distinct token each time (iat / exp differ)
    assert [issuer.tenant(token) for token in issued] == [f"tenant-{i}" for i in range(5)]
    assert len(issuer._verified) == 3
    assert issuer.tenant(issued[0]) == "tenant-0"  # verified again from its signature
