"""The account side of the SDK 0.38 through the real SDK against the real server: the audit log, checkpoint storage
and hourly usage (``AdminClient``, and ``RestClient``'s deprecated forms), session search and projects, the session
trace export, and ``tinker auth login``/``logout``'s key endpoints. Each key sees only its own."""

from __future__ import annotations

import collections
import warnings
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import tinker
from tinker import types
from tinker.cli.auth_api import AuthApiError, TinkerAuthApi

from tests.helpers import BASE_MODEL, make_datum, train

DATUM = make_datum([5, 6, 7, 8], [9, 10, 11])


@pytest.fixture(scope="module")
def history(server):
    """One key's session: a named session with metadata, a training run trained two steps, a saved state and
    sampler weights (published, given a TTL, unpublished), a copy, a deleted checkpoint, three samples."""
    key = "tml-test-account"
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key, project_id="proj-a",
                                   user_metadata={"team": "red"}, display_name="Red team sweep")
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    train(training, DATUM, 2)
    state = training.save_state("kept").result().path
    doomed = training.save_state("doomed").result().path
    sampler_path = training.save_weights_for_sampler("pub").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    rest.set_checkpoint_ttl_from_tinker_path(sampler_path, 3600).result()
    rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    rest.delete_checkpoint_from_tinker_path(doomed).result()
    sampler = training.create_sampling_client(sampler_path).result()
    for _ in range(3):
        sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)).result()
    return {"key": key, "service": service, "rest": rest, "state": state, "sampler_path": sampler_path,
            "doomed": doomed, "session_id": service.holder.get_session_id()}


def test_the_audit_log_lists_the_keys_own_actions(server, history):
    admin = tinker.AdminClient(base_url=server.base_url, api_key=history["key"])
    entries = admin.get_audit_log().result().entries
    events = [e.event for e in entries]
    for expected in ("apikey_use", "session_create", "training_run_create", "checkpoint_create",
                     "checkpoint_publish", "checkpoint_ttl_set", "checkpoint_unpublish", "checkpoint_delete"):
        assert expected in events, (expected, events)
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    deleted = next(e for e in entries if e.event == "checkpoint_delete")
    assert deleted.tinker_path == history["doomed"] and deleted.event_details["tinker_path"] == history["doomed"]
    only_checkpoints = admin.get_audit_log(event_type="checkpoints").result().entries
    assert only_checkpoints and all(e.event.startswith("checkpoint_") for e in only_checkpoints)
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    assert admin.get_audit_log(day=yesterday).result().entries == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert len(history["rest"].get_audit_log().result().entries) >= len(entries)  # the deprecated form
    stranger = tinker.AdminClient(base_url=server.base_url, api_key="tml-test-account-stranger")
    assert all(history["state"] not in str(e.event_details) for e in stranger.get_audit_log().result().entries)


def test_storage_and_usage_add_up_to_what_the_key_stored_and_trained(server, history):
    admin = tinker.AdminClient(base_url=server.base_url, api_key=history["key"])
    listed = history["rest"].list_user_checkpoints(limit=100).result().checkpoints
    usage = admin.get_current_checkpoint_storage_usage().result().data
    assert sum(i.checkpoint_count for i in usage) == len(listed) == 2  # kept and pub; doomed was deleted
    assert sum(i.size_bytes for i in usage) == sum(c.size_bytes for c in listed) > 0
    assert [i.project_id for i in usage] == ["proj-a"]
    assert admin.get_current_checkpoint_storage_usage(project_id="elsewhere").result().data == []
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    events = admin.get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=1)).result().data
    trained = sum(e.event_info.token_count for e in events if e.event_info.type == "training")
    assert trained == 2 * DATUM.model_input.length  # two forward_backward steps of one datum
    assert sum(e.event_info.count for e in events if e.event_info.type == "checkpoint") >= 3


def test_the_trace_export_holds_one_slice_per_request(server, history):
    url = history["rest"].export_session_trace(history["session_id"]).result()
    trace = httpx.get(url).json()  # a plain GET, no API key, as the SDK documents
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert collections.Counter(s["name"] for s in slices) == collections.Counter(
        {"create_model": 1, "forward_backward": 2, "optim_step": 2, "save_weights": 2, "save_weights_for_sampler": 1,
         "sample": 3})
    assert all(s["dur"] >= 0 and s["ts"] > 0 and isinstance(s["tid"], int) for s in slices)
    named = {e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {s["tid"] for s in slices} <= named  # every track is named (a training run or a sampling client)
    assert httpx.get(url.replace("signature=", "signature=0")).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=server.base_url, api_key="tml-test-account-stranger").export_session_trace(
            history["session_id"]).result()


def test_sessions_are_searched_and_moved_between_projects(server, history):
    rest = history["rest"]
    other = tinker.ServiceClient(base_url=server.base_url, api_key=history["key"], display_name="blue run",
                                 user_metadata={"team": "blue"})
    other_id = other.holder.get_session_id()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        def search(**fields):
            return rest.search_sessions(types.SessionSearchRequest(**fields)).result()
        by_name = search(display_name="team red")
        assert [s.session_id for s in by_name.sessions] == [history["session_id"]]
        assert by_name.sessions[0].checkpoints_count == 2 and by_name.sessions[0].project_id == "proj-a"
        assert [s.session_id for s in search(user_metadata={"team": "blue"}).sessions] == [other_id]
        first = search(limit=1)
        assert [s.session_id for s in first.sessions] == [other_id] and first.next_cursor is not None  # newest first
        second = search(limit=1, cursor=first.next_cursor)
        assert [s.session_id for s in second.sessions] == [history["session_id"]] and second.next_cursor is None
        assert {s.status.type for s in search(statuses=[{"type": "active"}]).sessions} == {"active"}
        rest.assign_session_project(other_id, "proj-b").result()
        assert [s.session_id for s in search(project_ids=["proj-b"]).sessions] == [other_id]
        stranger_rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test-account-stranger")
        theirs = stranger_rest.search_sessions(types.SessionSearchRequest()).result().sessions
        assert {other_id, history["session_id"]}.isdisjoint(s.session_id for s in theirs)
        with pytest.raises(tinker.NotFoundError):
            stranger_rest.assign_session_project(other_id, "mine").result()


def test_auth_login_checks_a_key_and_logout_revokes_only_it(keyed_server):
    server, keys = keyed_server
    api = TinkerAuthApi(httpx.Client(), base_url=server.base_url)
    assert api.get_self_api_key(keys["logs-out"]).name == "logs-out"
    with pytest.raises(AuthApiError, match="401"):
        api.get_self_api_key("tml-never-issued")
    api.delete_self_api_key(keys["logs-out"])
    with pytest.raises(AuthApiError, match="401"):
        api.get_self_api_key(keys["logs-out"])
    assert api.get_self_api_key(keys["alice"]).name == "alice"  # only the caller's own key went


def test_an_open_server_has_no_keys_to_revoke(server):
    api = TinkerAuthApi(httpx.Client(), base_url=server.base_url)
    assert api.get_self_api_key("tml-test-anyone").name == "open-auth key"
    with pytest.raises(AuthApiError, match="nothing to revoke"):
        api.delete_self_api_key("tml-test-anyone")


def test_the_sdk_trades_its_key_for_a_token_and_whoami_reads_it(server):
    """``pjwt_auth_enabled``: the SDK exchanges its key at /api/v1/auth/token and sends the token instead; whoami
    reads the identity from it. A forged token answers ``invalid_token`` (the SDK then exchanges its key again)."""
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test-whoami")
    me = rest.whoami().result()
    assert me.user_urn.startswith("tml:user:") and me.org_urn == "tml:organization:compat-server"
    other = tinker.RestClient(base_url=server.base_url, api_key="tml-test-whoami-2").whoami().result()
    assert other.user_urn != me.user_urn
    token = httpx.post(f"{server.base_url}/api/v1/auth/token", json={}, headers={"X-API-Key": "tml-test-whoami"})
    jwt = token.json()["jwt"]
    assert httpx.get(f"{server.base_url}/api/v1/sessions", headers={"X-API-Key": jwt}).status_code == 200
    forged = jwt[:-4] + ("AAAA" if not jwt.endswith("AAAA") else "BBBB")
    refused = httpx.get(f"{server.base_url}/api/v1/sessions", headers={"X-API-Key": forged})
    assert refused.status_code == 401 and 'error="invalid_token"' in refused.headers["www-authenticate"]


def test_a_token_dies_with_its_key(keyed_server):
    """Under ``--auth keys`` a token is only as good as the key it was issued for, checked at every request."""
    server, keys = keyed_server
    jwt = httpx.post(f"{server.base_url}/api/v1/auth/token", json={},
                     headers={"X-API-Key": keys["token-holder"]}).json()["jwt"]
    assert httpx.get(f"{server.base_url}/api/v1/sessions", headers={"X-API-Key": jwt}).status_code == 200
    TinkerAuthApi(httpx.Client(), base_url=server.base_url).delete_self_api_key(keys["token-holder"])
    assert httpx.get(f"{server.base_url}/api/v1/sessions", headers={"X-API-Key": jwt}).status_code == 401


def test_sessions_with_any_json_metadata_are_searchable(server):
    """``create_session`` takes user metadata with any JSON values (the fuzz run sent numbers, lists, null); search
    and get_session answer them as JSON text instead of failing with a 500."""
    key = {"X-API-Key": "tml-test-account-json"}
    created = httpx.post(f"{server.base_url}/api/v1/create_session", headers=key, json={
        "tags": [], "user_metadata": {"n": 5, "xs": [1, None], "ok": "yes"}, "sdk_version": "raw", "type": "create_session"})
    assert created.status_code == 200
    found = httpx.post(f"{server.base_url}/api/v1/sessions/search", headers=key, json={"user_metadata": {"n": "5"}})
    assert found.status_code == 200, found.text
    [summary] = found.json()["sessions"]
    assert summary["user_metadata"] == {"n": "5", "xs": "[1, null]", "ok": "yes"}
    session = httpx.get(f"{server.base_url}/api/v1/sessions/{summary['session_id']}", headers=key)
    assert session.status_code == 200 and session.json()["user_metadata"]["xs"] == "[1, null]"
