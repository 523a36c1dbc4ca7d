"""Access is checked at every use, not only when a handle is made: two registered keys, through the real SDKs.

Key A publishes a sampler checkpoint and key B opens a sampling session on it (and asks for download URLs). When A
unpublishes, deletes and saves again under the same name, or lets the checkpoint expire, B's old handles stop at
their next use, and nothing of A's new weights is ever served through them; A's own handles keep working.
The server sweeps expired checkpoints only hourly here, so an expired checkpoint's files are still on disk when the
tests check that it is refused: the refusal comes from the check at use, not from the files being gone.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL, checkpoint_dir, make_datum, train

PROMPT = [5, 6, 7, 8, 9]
LR = types.AdamParams(learning_rate=5e-2)


@pytest.fixture(scope="module")
def tenants(keyed_server):
    """The ``--auth keys`` server (hourly expiry sweep), alice's and bob's keys, and a service client for each."""
    server, issued = keyed_server
    clients = {name: tinker.ServiceClient(base_url=server.base_url, api_key=issued[name]) for name in ("alice", "bob")}
    yield server, issued, clients
    for client in clients.values():
        client.close("success")


def prompt_logprobs(sampler) -> np.ndarray:
    return np.array(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:])


def sample_once(sampler) -> types.SampleResponse:
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=3, seed=1)).result()


def assert_refused(sampler) -> None:
    """Both calls through an old sampling client fail as user errors that say why."""
    for call in (prompt_logprobs, sample_once):
        with pytest.raises(tinker.RequestFailedError, match="no longer available to this key") as failure:
            call(sampler)
        assert failure.value.category == types.RequestErrorCategory.User


def rest(tenants, name: str) -> tinker.RestClient:
    server, issued, _ = tenants
    return tinker.RestClient(base_url=server.base_url, api_key=issued[name])


def published_checkpoint(tenants, name: str, seed: int, external: bool = False):
    """A training client of alice's, trained a little, with a published sampler checkpoint ``name`` (or exported
    weights, which the SDK downloads)."""
    training = tenants[2]["alice"].create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=seed).result()
    train(training, make_datum(PROMPT, [40, 41]), 2, LR)
    path = (training.save_weights_external if external else training.save_weights_for_sampler)(name).result().path
    rest(tenants, "alice").publish_checkpoint_from_tinker_path(path).result()
    return training, path


def test_unpublishing_stops_other_keys_sessions_at_their_next_request(tenants):
    server, issued, clients = tenants
    _, path = published_checkpoint(tenants, "shared", seed=1)
    alices = clients["alice"].create_sampling_client(model_path=path).result()
    bobs = clients["bob"].create_sampling_client(model_path=path).result()
    np.testing.assert_allclose(prompt_logprobs(bobs), prompt_logprobs(alices), atol=1e-6)
    bob_openai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=issued["bob"], max_retries=0)
    chat = {"model": path, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert bob_openai.chat.completions.create(**chat).choices

    rest(tenants, "alice").unpublish_checkpoint_from_tinker_path(path).result()
    assert_refused(bobs)
    with pytest.raises(tinker.NotFoundError):
        clients["bob"].create_sampling_client(model_path=path).result()
    with pytest.raises(openai.NotFoundError):
        bob_openai.chat.completions.create(**chat)
    assert sample_once(alices).sequences  # the owner's own session is untouched


def test_a_new_save_under_a_deleted_name_is_never_served_through_an_old_session(tenants):
    clients = tenants[2]
    training, path = published_checkpoint(tenants, "reused", seed=2)
    bobs = clients["bob"].create_sampling_client(model_path=path).result()
    alices_old = clients["alice"].create_sampling_client(model_path=path).result()
    before = prompt_logprobs(bobs)

    rest(tenants, "alice").delete_checkpoint_from_tinker_path(path).result()
    train(training, make_datum(PROMPT, [60, 61]), 3, LR)  # different weights ...
    assert training.save_weights_for_sampler("reused").result().path == path  # ... private, under the same name
    alices_new = clients["alice"].create_sampling_client(model_path=path).result()
    after = prompt_logprobs(alices_new)
    assert np.abs(after - before).max() > 1e-3  # the new save really differs

    assert_refused(bobs)
    assert_refused(alices_old)  # even the owner's old session was on the deleted save, not the new one
    with pytest.raises(tinker.NotFoundError):
        clients["bob"].create_sampling_client(model_path=path).result()


def test_download_urls_are_checked_against_the_checkpoint_as_it_is_when_used(tenants):
    training, path = published_checkpoint(tenants, "downloadable", seed=3, external=True)
    alice_rest, bob_rest = rest(tenants, "alice"), rest(tenants, "bob")
    bobs_urls = bob_rest.get_external_weights_urls(path).result().urls
    alices_urls = alice_rest.get_external_weights_urls(path).result().urls
    url = bobs_urls["adapter_model.safetensors"]
    original = httpx.get(url)
    assert original.status_code == 200 and original.content

    alice_rest.unpublish_checkpoint_from_tinker_path(path).result()
    refused = httpx.get(url)
    assert refused.status_code == 403 and "no longer published" in refused.text
    assert httpx.get(alices_urls["adapter_model.safetensors"]).status_code == 200  # the owner's URL still works

    alice_rest.delete_checkpoint_from_tinker_path(path).result()
    train(training, make_datum(PROMPT, [70, 71]), 2, LR)
    training.save_weights_external("downloadable").result()  # private, same name, new weights
    alice_rest.publish_checkpoint_from_tinker_path(path).result()  # even published again: a new save, new URLs
    for old in (url, alices_urls["adapter_model.safetensors"]):
        gone = httpx.get(old)
        assert gone.status_code == 404 and "no longer exists as it was" in gone.text
    fresh = httpx.get(bob_rest.get_external_weights_urls(path).result().urls["adapter_model.safetensors"])
    assert fresh.status_code == 200 and fresh.content != original.content


def test_an_expired_checkpoint_is_refused_at_once_not_when_its_files_are_swept(tenants):
    server, _, clients = tenants
    training, path = published_checkpoint(tenants, "short-lived", seed=4)
    exported = training.save_weights_external("short-lived").result().path
    rest(tenants, "alice").publish_checkpoint_from_tinker_path(exported).result()
    alices = clients["alice"].create_sampling_client(model_path=path).result()
    bobs = clients["bob"].create_sampling_client(model_path=path).result()
    url = rest(tenants, "bob").get_external_weights_urls(exported).result().urls["adapter_config.json"]
    assert sample_once(bobs).sequences and httpx.get(url).status_code == 200
    for short_lived in (path, exported):
        rest(tenants, "alice").set_checkpoint_ttl_from_tinker_path(short_lived, 1).result()
    time.sleep(1.5)
    assert checkpoint_dir(server.data_dir, path).exists()  # not swept yet (hourly here)
    assert_refused(alices)
    assert_refused(bobs)
    assert httpx.get(url).status_code == 404


def test_metrics_and_dashboard_show_a_key_its_own_figures_and_an_operator_the_servers(tenants):
    """Once, every key saw server-wide figures: other tenants' request and token counts, latencies, the drift of
    their adapters, the replicas' load. Now a key sees its own; an operator key (``keys create --admin``) the
    server's."""
    server, issued, clients = tenants

    def metrics(headers: dict) -> dict:
        return httpx.get(f"{server.base_url}/api/v1/metrics", headers=headers).json()

    bob = {"X-API-Key": issued["bob"]}
    bobs_before, server_before = metrics(bob), metrics(server.admin)
    samplers = {name: clients[name].create_sampling_client(base_model=BASE_MODEL).result() for name in clients}
    for name, count in (("bob", 3), ("alice", 2)):
        for _ in range(count):
            sample_once(samplers[name])
    bobs, everyone = metrics(bob), metrics(server.admin)

    def grew(after: dict, before: dict, field: str) -> int:
        return after["sampling"][BASE_MODEL][field] - before["sampling"][BASE_MODEL][field]

    assert bobs["scope"] == "key" and grew(bobs, bobs_before, "requests") == 3  # alice's two are not his
    assert grew(bobs, bobs_before, "sampled_tokens") == 3 * 3
    assert "replicas" not in bobs["sampling"][BASE_MODEL] and "training" not in bobs
    assert bobs["futures"]["completion"]["count"] - bobs_before["futures"]["completion"]["count"] == 3
    assert everyone["scope"] == "server" and grew(everyone, server_before, "requests") == 5
    assert everyone["sampling"][BASE_MODEL]["replicas"] and BASE_MODEL in everyone["training"]
    assert everyone["futures"]["completion"]["count"] > bobs["futures"]["completion"]["count"]

    board = httpx.get(f"{server.base_url}/api/v1/dashboard", headers=bob).json()["samplers"][BASE_MODEL]
    assert board["requests"] == bobs["sampling"][BASE_MODEL]["requests"] and "replicas" not in board
    assert "replicas" in httpx.get(f"{server.base_url}/api/v1/dashboard", headers=server.admin).json()["samplers"][
        BASE_MODEL]
