"""API keys (``--auth keys``, the ``keys`` commands) and tenant isolation across the Tinker and OpenAI routes."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
import tinker

from tests.helpers import BASE_MODEL, MAIN_KEY, make_datum
from tests.helpers import keys_command as keys


def test_only_registered_keys_get_in_and_revocation_is_immediate(keyed_server):
    server, issued = keyed_server
    key = issued["revoked-soon"]
    assert key.startswith("tml-") and key not in (server.data_dir / "records.sqlite3").read_bytes().decode(
        errors="replace")  # only a hash is stored
    assert "auth: keys" in server.log()
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
    training.forward_backward([make_datum([1, 2], [3])], "cross_entropy").result()
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    assert oai.models.list().data
    for stranger in ("tml-not-registered", "sk-wrong-prefix"):
        assert httpx.get(f"{server.base_url}/api/v1/training_runs", headers={"X-API-Key": stranger}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=stranger, max_retries=0).models.list()

    listed = keys(server.data_dir, "list")
    assert "revoked-soon" in listed.stdout and "active" in listed.stdout
    assert keys(server.data_dir, "revoke", "revoked-soon").returncode == 0
    assert "revoked" in keys(server.data_dir, "list").stdout
    assert httpx.get(f"{server.base_url}/api/v1/training_runs", headers={"X-API-Key": key}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        oai.models.list()
    assert keys(server.data_dir, "revoke", "revoked-soon").returncode == 1  # nothing active left to revoke
    client.close("success")


def test_open_auth_is_refused_on_a_reachable_address():
    refused = subprocess.run([sys.executable, "-m", "compat_server.cli", "serve", "--host", "0.0.0.0", "--auth",
                              "open"], capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "--allow-open-auth" in refused.stderr


def test_another_key_cannot_reach_private_objects(server, service_client):
    """Key B, through every door, against key A's unpublished run, checkpoints and futures: always "not found"."""
    owner = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=3).result()
    owner.forward_backward([make_datum([1, 2], [3])], "cross_entropy").result()
    sampler_path = owner.save_weights_for_sampler("private").result().path
    state_path = owner.save_state("private-state").result().path
    mine, theirs = {"X-API-Key": MAIN_KEY}, {"X-API-Key": "tml-test-stranger"}
    sample = {"num_samples": 1, "base_model": BASE_MODEL, "sampling_params": {"max_tokens": 1},
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}
    request_id = httpx.post(f"{server.base_url}/api/v1/asample", headers=mine, json=sample).json()["request_id"]
    poll = {"request_id": request_id}
    assert httpx.post(f"{server.base_url}/api/v1/retrieve_future", headers=theirs, json=poll).status_code == 404
    assert httpx.post(f"{server.base_url}/api/v1/retrieve_future", headers=mine, json=poll,
                      timeout=60).status_code == 200
    info = httpx.post(f"{server.base_url}/api/v1/get_info", headers=theirs, json={"model_id": owner.model_id})
    assert info.status_code == 404 and "unknown model_id" in info.text
    created = httpx.post(f"{server.base_url}/api/v1/create_sampling_session", headers=mine, json={
        "session_id": service_client.holder.get_session_id(), "sampling_session_seq_id": 9999,
        "base_model": BASE_MODEL}).json()["sampling_session_id"]
    assert httpx.get(f"{server.base_url}/api/v1/samplers/{created}", headers=mine).status_code == 200
    assert httpx.get(f"{server.base_url}/api/v1/samplers/{created}", headers=theirs).status_code == 404

    stranger = tinker.ServiceClient(base_url=server.base_url, api_key=theirs["X-API-Key"])
    try:
        with pytest.raises(tinker.NotFoundError):
            stranger.create_sampling_client(model_path=sampler_path).result()
        with pytest.raises(tinker.RequestFailedError, match="not found"):
            stranger.create_training_client_from_state(state_path).result()
        rest = tinker.RestClient(base_url=server.base_url, api_key=theirs["X-API-Key"])
        with pytest.raises(tinker.NotFoundError):
            rest.get_weights_info_by_tinker_path(state_path).result()
        with pytest.raises(tinker.NotFoundError):
            rest.set_checkpoint_ttl_from_tinker_path(state_path, 7200).result()
    finally:
        stranger.close("success")

    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=theirs["X-API-Key"], max_retries=0)
    assert sampler_path not in {m.id for m in oai.models.list().data}
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model=sampler_path, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve(sampler_path)
