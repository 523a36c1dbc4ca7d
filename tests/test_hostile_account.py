"""Part of issue 31's hostile-tenant tests, the account side (rows 8 to 10): dates out of range, oversized session
fields, and a token buying another token. Each test asserts the attacker's refusal (a clear user error, in the
shape the tinker SDK reads) AND that another tenant and the server are unaffected: the other key's requests still
work, nothing oversized is stored, and a search answers a bounded page."""

from __future__ import annotations

import warnings
from datetime import date

import httpx
import pytest
import tinker
from tinker import types

from compat_server.config import ServerConfig

LIMITS = ServerConfig().sessions
"""The defaults of the session limits, which ``keyed_server`` runs with."""
BIG = "x" * (8 << 20)
"""What issue 31's hostile tenant stored in a session's fields: 8 MiB."""


def refused(response: httpx.Response, status: int, *words: str) -> None:
    """A Tinker-shaped user error whose message says what was wrong."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    body = response.json()
    assert body["category"] == "user", body
    for word in words:
        assert word in body["error"], (word, body["error"][:300])


def test_dates_out_of_range_are_user_errors_and_the_other_tenant_is_served(keyed_server):
    """Row 8: ``9999-12-31`` (whose next midnight no datetime holds) and times whose UTC form falls before the year
    1 or after 9999 answered 500 ``OverflowError``."""
    server, keys = keyed_server
    url, alice, bob = server.base_url, {"X-API-Key": keys["alice"]}, {"X-API-Key": keys["bob"]}
    with pytest.raises(tinker.BadRequestError, match="out of range"):
        tinker.AdminClient(base_url=url, api_key=keys["alice"]).get_audit_log(day=date.max).result()
    refused(httpx.get(f"{url}/api/v1/audit", params={"day": "9999-12-31"}, headers=alice), 400, "9999-12-31")
    for start, end in (("0001-01-01T00:00:00+05:00", "0001-01-02T00:00:00+05:00"),
                       ("9999-12-31T23:00:00-02:00", "9999-12-31T23:30:00-02:00")):
        usage = httpx.get(f"{url}/api/v1/billing/usage/events", params={"starting_on": start, "ending_before": end},
                          headers=alice)
        refused(usage, 400, "starting_on", "out of range")
    for moment in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"):
        cursor = {"last_created_at": moment, "last_session_id": "x"}
        refused(httpx.post(f"{url}/api/v1/sessions/search", json={"cursor": cursor}, headers=alice), 400,
                "cursor.last_created_at", "out of range")
    # A window that fits in a datetime but ends at its very edge is simply empty.
    edge = httpx.get(f"{url}/api/v1/billing/usage/events", headers=alice,
                     params={"starting_on": "9999-12-31T00:00:00Z", "ending_before": "9999-12-31T05:00:00Z"})
    assert edge.status_code == 200 and edge.json()["data"] == [], edge.text

    for key in (keys["bob"], keys["alice"]):  # the other tenant, and the attacker's own honest requests
        entries = tinker.AdminClient(base_url=url, api_key=key).get_audit_log().result().entries
        assert any(e.event == "apikey_use" for e in entries)
    window = {"starting_on": "2024-01-01T00:00:00Z", "ending_before": "2024-01-02T00:00:00Z"}
    usage = httpx.get(f"{url}/api/v1/billing/usage/events", params=window, headers=bob)
    assert usage.status_code == 200 and usage.json()["data"] == [], usage.text
    later = {"last_created_at": "9999-12-31T23:59:59Z", "last_session_id": "x"}
    assert httpx.post(f"{url}/api/v1/sessions/search", json={"cursor": later}, headers=bob).status_code == 200
    assert "OverflowError" not in server.log()


def test_oversized_session_fields_are_refused_and_a_search_page_stays_bounded(keyed_server):
    """Row 9: 8 MiB display names, tags, projects and metadata were stored, and a session search answered them all
    (336 MiB). Each is refused at creation (and a project at assignment), naming its option; what the limits admit
    is stored, and a full search page stays within what 200 such sessions can hold."""
    server, keys = keyed_server
    url, alice = server.base_url, {"X-API-Key": keys["alice"]}
    over = "y" * (LIMITS.field_chars + 1)
    hostile = [({"display_name": BIG}, "--max-session-field-chars"), ({"display_name": over}, "display_name"),
               ({"project_id": BIG}, "--max-session-field-chars"), ({"sdk_version": BIG}, "sdk_version"),
               ({"tags": [BIG]}, "--max-session-field-chars"),
               ({"tags": ["t"] * (LIMITS.tags + 1)}, "--max-session-tags"),
               ({"user_metadata": {"k": BIG}}, "--max-session-metadata-bytes")]
    for fields, words in hostile:
        body = {"tags": [], "user_metadata": None, "sdk_version": "raw", "type": "create_session", **fields}
        refused(httpx.post(f"{url}/api/v1/create_session", json=body, headers=alice, timeout=60), 400, words)
    with pytest.raises(tinker.BadRequestError, match="--max-session-field-chars"):  # the SDK's own session creation
        tinker.ServiceClient(base_url=url, api_key=keys["alice"], display_name=over).holder.get_session_id()

    # The most the limits admit is accepted, and a project too long for them is refused on assignment too.
    most = {"tags": ["t" * LIMITS.field_chars] * LIMITS.tags, "sdk_version": "raw",
            "type": "create_session", "display_name": "n" * LIMITS.field_chars,
            "project_id": "p" * LIMITS.field_chars,
            "user_metadata": {"k": "v" * (LIMITS.metadata_bytes - len('{"k": ""}'))}}
    created = httpx.post(f"{url}/api/v1/create_session", json=most, headers=alice)
    assert created.status_code == 200, created.text
    session_id = created.json()["session_id"]
    refused(httpx.put(f"{url}/api/v1/sessions/{session_id}/project", json={"project_id": BIG}, headers=alice), 400,
            "--max-session-field-chars")

    page = httpx.post(f"{url}/api/v1/sessions/search", json={"limit": 200}, headers=alice)
    assert page.status_code == 200, page.text
    sessions = page.json()["sessions"]
    assert session_id in [s["session_id"] for s in sessions]
    assert all(len(s["display_name"] or "") <= LIMITS.field_chars for s in sessions)
    per_session = 2 * LIMITS.metadata_bytes + 2 * LIMITS.field_chars + 1024  # JSON escapes
    assert len(page.content) <= 200 * per_session
    refused(httpx.post(f"{url}/api/v1/sessions/search", json={"limit": 201}, headers=alice), 400, "limit")

    # The other tenant creates, finds and reads its own session as ever.
    with tinker.ServiceClient(base_url=url, api_key=keys["bob"], display_name="bob's sweep",
                              user_metadata={"team": "blue"}) as service:
        bobs = service.holder.get_session_id()
        rest = tinker.RestClient(base_url=url, api_key=keys["bob"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # search_sessions is experimental in the SDK
            found = rest.search_sessions(types.SessionSearchRequest(display_name="bob's sweep")).result().sessions
        assert [s.session_id for s in found] == [bobs] and found[0].user_metadata == {"team": "blue"}
        assert rest.get_session(bobs).result().user_metadata == {"team": "blue"}


def test_a_token_cannot_buy_another_token_and_keys_still_can(keyed_server):
    """Row 10: ``/api/v1/auth/token`` authenticated by a token it had issued gave a fresh token, so a leaked token
    renewed itself for as long as its key lived. Only the key buys one now; the unmodified SDK, which exchanges its
    key and refreshes by exchanging the key again, works as before."""
    server, keys = keyed_server
    url = server.base_url
    jwt = httpx.post(f"{url}/api/v1/auth/token", json={}, headers={"X-API-Key": keys["alice"]}).json()["jwt"]
    for headers in ({"X-API-Key": jwt}, {"Authorization": f"Bearer {jwt}"}):
        refused(httpx.post(f"{url}/api/v1/auth/token", json={}, headers=headers), 403, "cannot be exchanged",
                "API key")
    with pytest.raises(tinker.PermissionDeniedError, match="cannot be exchanged"):  # the SDK handed the token
        tinker.RestClient(base_url=url, api_key=jwt).whoami().result()
    # The token still serves until it expires, and the key still buys tokens.
    assert httpx.get(f"{url}/api/v1/sessions", headers={"X-API-Key": jwt}).status_code == 200
    assert httpx.post(f"{url}/api/v1/auth/token", json={}, headers={"X-API-Key": keys["alice"]}).status_code == 200

    rest = tinker.RestClient(base_url=url, api_key=keys["bob"])
    me = rest.whoami().result()
    assert me.email == "bob@compat-server"
    auth = rest.holder._default_auth  # the SDK's token provider: a refresh is its _fetch, which sends the key
    refreshed = rest.holder.run_coroutine_threadsafe(auth._fetch()).result()
    assert httpx.get(f"{url}/api/v1/sessions", headers={"X-API-Key": refreshed}).status_code == 200
    assert rest.whoami().result() == me
