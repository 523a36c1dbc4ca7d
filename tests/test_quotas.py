"""The per-key request quota that both the Tinker futures and the OpenAI completions count against."""

from __future__ import annotations

import pytest

from compat_server.access.quotas import KeyQuota, TooManyRequests


def test_a_key_at_its_limit_is_refused_until_a_request_finishes_and_other_keys_are_not():
    quota = KeyQuota(2)
    quota.acquire("a")
    with quota.hold("a"):
        with pytest.raises(TooManyRequests, match="2 unfinished requests"):
            quota.acquire("a")
        quota.acquire("b")  # another key has its own count
    quota.acquire("a")  # the held one was given back
    assert quota.usage("a") == {"pending": 2, "limit": 2, "refused": 1}
    quota.release("a")
    quota.release("a")
    assert quota.usage("a")["pending"] == 0


def test_a_block_that_fails_still_gives_its_count_back_and_admitted_work_is_never_refused():
    quota = KeyQuota(1)
    with pytest.raises(RuntimeError), quota.hold("a"):
        raise RuntimeError("the request failed")
    quota.check("a")
    quota.acquire("a")
    with quota.hold("a", checked=False):  # admitted earlier by ``check``: counted, not refused
        assert quota.pending("a") == 2
    assert KeyQuota(None).usage("a")["limit"] is None


def test_a_chat_request_of_a_key_at_its_limit_is_refused_before_any_work_is_done_for_it():
    """The OpenAI routes check the count before loading a tokenizer or rendering a chat: refused work costs
    nothing, and the refusal does not depend on whether the requests that fill the count finish meanwhile."""
    import asyncio

    from compat_server.completions.service import CompletionsService

    class NoWork:
        def __getattr__(self, name):
            raise AssertionError(f"work was done for a refused request: {name}")

    quota = KeyQuota(1)
    quota.acquire("a")
    service = CompletionsService(NoWork(), NoWork(), {}, quota, NoWork(), NoWork())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(TooManyRequests, match="max-pending-per-key 1"):
        asyncio.run(service.prepare("a", body, chat=True))
    assert quota.usage("a")["refused"] == 1
