"""The SDK 0.38's futures features, through the real SDK against the real server (transformers sampler): one
``retrieve_futures`` long poll for all of a sampling client's pending samples, clone numbers for unpickled sampling
clients (``join_sampling_session``), and ``cancel_future`` for abandoned samples."""

from __future__ import annotations

import concurrent.futures
import hashlib
import pickle
import sqlite3
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL, MAIN_KEY, one_request, poll_future, settled_decoded_tokens

PROMPT = types.ModelInput.from_ints([11, 42, 77, 103, 250])
SHORT = types.SamplingParams(max_tokens=3, temperature=1.0)
SAMPLES = 32


def key_metrics(server, key: str) -> dict:
    return httpx.get(f"{server.base_url}/api/v1/metrics", headers={"X-API-Key": key}).json()["futures"]


def sample_many(sampler, n: int) -> list[types.SampleResponse]:
    futures = [sampler.sample(PROMPT, num_samples=1, sampling_params=SHORT) for _ in range(n)]
    return [f.result() for f in futures]


def test_one_poll_stands_for_many_pending_samples(server):
    """The server turns on ``sample_use_retrieve_futures``: a sampling client then holds one long poll for all its
    pending samples and fetches each result once, instead of holding one ``retrieve_future`` per sample. The same
    load with the flag turned off in the client (the SDK's per-request polling) is the comparison."""
    figures = {}
    for per_request in (True, False):
        key = f"tml-test-polls-{'per-request' if per_request else 'session'}"
        client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
        config = client.holder.get_client_config()
        assert config.sample_use_retrieve_futures and config.sample_join_sampling_session
        if per_request:  # the client-side choice the SDK makes when a server does not offer retrieve_futures
            client.holder._client_config = config.model_copy(update={"sample_use_retrieve_futures": False})
        sampler = client.create_sampling_client(base_model=BASE_MODEL).result()
        results = sample_many(sampler, SAMPLES)
        assert all(len(r.sequences) == 1 and 1 <= len(r.sequences[0].tokens) <= 3 for r in results)
        figures[per_request] = key_metrics(server, key)
    before, after = figures[True], figures[False]
    held_before = before["retrieve_future"]["held"] + before["retrieve_futures"]["count"]
    held_after = after["retrieve_future"]["held"] + after["retrieve_futures"]["held"]
    print(f"per sample, before: {before['retrieve_future']['count'] / SAMPLES:.2f} retrieve_future calls, "
          f"{held_before / SAMPLES:.2f} held long polls; after: {after['retrieve_future']['count'] / SAMPLES:.2f} "
          f"retrieve_future, {after['retrieve_futures']['count'] / SAMPLES:.2f} retrieve_futures, "
          f"{held_after / SAMPLES:.2f} held")
    # Per-request polling: one retrieve_future per sample, no session poll. How many of them are held depends on how
    # fast the sampler is (a sample done before its first poll is answered at once), so only the count is asserted.
    assert before["retrieve_futures"]["count"] == 0 and before["retrieve_future"]["count"] >= SAMPLES
    assert after["retrieve_future"]["count"] == SAMPLES  # one payload fetch per sample…
    assert after["retrieve_future"]["held"] == 0  # …answered at once: the session poll said it was ready
    # One poll per batch of completions (the sampler finishes requests in batches), never one per sample. How many
    # batches the 32 make depends on how fast they arrive, so only "fewer than one per sample" is asserted.
    assert after["retrieve_futures"]["count"] < SAMPLES and held_after < SAMPLES


def test_retrieve_futures_reports_failures_and_refuses_other_keys(server, service_client):
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    bad = sampler.sample(types.ModelInput.from_ints([10**9]), num_samples=1, sampling_params=SHORT)
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        bad.result(timeout=60)  # a failed sample reaches its waiter through the session poll, too
    body = {"target": {"type": "sampling_session", "sampling_session_id": sampler._sampling_session_id},
            "prev_cursor": 0, "timeout": 0}
    mine = httpx.post(f"{server.base_url}/api/v1/retrieve_futures", json=body, headers={"X-API-Key": MAIN_KEY})
    assert mine.status_code == 200 and any(c["state"] == "failed" for c in mine.json()["completions"])
    theirs = httpx.post(f"{server.base_url}/api/v1/retrieve_futures", json=body,
                        headers={"X-API-Key": "tml-test-someone-else"})
    assert theirs.status_code == 404


def test_unpickled_sampling_clients_get_distinct_clone_numbers(server, service_client):
    """``sample_join_sampling_session``: each unpickled copy asks the server for its clone number, so the copies'
    ``seq_id`` blocks never collide (the SDK otherwise picks a random one)."""
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    sampler.sample(PROMPT, num_samples=1, sampling_params=SHORT).result()
    clones = [pickle.loads(pickle.dumps(sampler)) for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # each clone samples (its first sample joins first)
        results = list(pool.map(lambda c: sample_many(c, 4), clones))
    assert all(len(r) == 4 for r in results)
    assert sorted(c._cloned_sampler_id for c in clones) == [1, 2, 3]
    refused = httpx.post(f"{server.base_url}/api/v1/join_sampling_session",
                         json={"sampling_session_id": sampler._sampling_session_id},
                         headers={"X-API-Key": "tml-test-someone-else"})
    assert refused.status_code == 404


def test_an_abandoned_sample_is_cancelled_on_the_server(server, tiny_model_dir):
    """A sample whose caller gives up (cancels the SDK's future) is cancelled with ``cancel_future``
    (``sample_cancel_enabled``): its future fails as cancelled long before its 2,000 tokens could be decoded, and
    the sampler goes on serving."""
    key = "tml-test-cancel"
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    sampler = client.create_sampling_client(base_model=BASE_MODEL).result()
    sampler.sample(PROMPT, num_samples=1, sampling_params=SHORT).result()  # warm
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(tiny_model_dir)).encode("Once upon a time")  # greedy: no EOS for
    long = types.SamplingParams(max_tokens=2000, temperature=0.0)  # 2,000 tokens (test_openai_sdk's long request)
    before = settled_decoded_tokens(server)
    future = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=long)
    with pytest.raises(TimeoutError):  # the tiny model decodes ~1,200 tokens/s alone on CI's CPU
        future.result(timeout=0.3)
    future.future().cancel()  # the caller gives up: cancelling the SDK's future cancels the operation
    owner = hashlib.sha256(key.encode()).hexdigest()
    deadline = time.monotonic() + 30
    while True:
        with sqlite3.connect(server.data_dir / "records.sqlite3") as db:
            rows = db.execute("SELECT state, error FROM futures WHERE owner = ? AND kind = 'sample' "
                              "ORDER BY created DESC LIMIT 1", [owner]).fetchall()
        if rows and rows[0][0] != "pending" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rows[0][0] == "failed" and "cancelled" in rows[0][1], rows
    decoded = settled_decoded_tokens(server) - before
    assert decoded < 1900, f"{decoded} of 2000 tokens were decoded for a sample cancelled after 0.3 s"
    again = sampler.sample(PROMPT, num_samples=1, sampling_params=SHORT).result(timeout=60)
    assert 1 <= len(again.sequences[0].tokens) <= 3


@pytest.fixture(scope="module")
def quick_polls(model_cache, tmp_path_factory):
    """A server of its own whose polls are held a tenth of a second, so a waiting request's ``try_again`` comes while
    it waits, however fast the machine runs the request it waits behind."""
    from tests.server import start_server

    running = start_server(tmp_path_factory.mktemp("quick-polls"), "--poll-hold-seconds", "0.1")
    yield running
    running.stop()


def test_a_request_waiting_for_the_trainer_says_so_in_its_try_again(quick_polls):
    """A request queued behind another tenant's batch answers ``try_again`` with hosted Tinker's
    ``paused_capacity`` and why; once its batch starts it is ``active`` again, and its result comes as usual."""
    server = quick_polls
    clients = {key: tinker.ServiceClient(base_url=server.base_url, api_key=key).create_lora_training_client(
        base_model=BASE_MODEL, rank=4) for key in ("tml-queue-long", "tml-queue-short")}
    long = [types.Datum(model_input=types.ModelInput.from_ints([(7 * i + j) % 400 for j in range(1024)]),
                        loss_fn_inputs={"target_tokens": np.full(1024, 5, np.int64), "weights": np.ones(1024, np.float32)})
            for i in range(8)]  # about a second of the tiny model's trainer on two idle cores

    def polls(request_id: str, key: str) -> tuple[list[tuple[str, str | None]], httpx.Response]:
        states = []
        while True:
            answer = httpx.post(f"{server.base_url}/api/v1/retrieve_future", headers={"X-API-Key": key},
                                json={"request_id": request_id}, timeout=60)
            if not answer.headers["content-type"].startswith("application/json") \
                    or answer.json().get("type") != "try_again":
                return states, answer
            states.append((answer.json()["queue_state"], answer.json().get("queue_state_reason")))
            if key == "tml-queue-long":
                return states, answer

    busy = one_request(server.base_url, "tml-queue-long", clients["tml-queue-long"].model_id, 1, long)
    running, _ = polls(busy, "tml-queue-long")  # its batch holds the trainer now (nothing else runs on this server)
    assert running == [("active", None)]
    short = one_request(server.base_url, "tml-queue-short", clients["tml-queue-short"].model_id, 1, long[:1])
    states, answer = polls(short, "tml-queue-short")
    assert answer.headers["content-type"].startswith("application/x-protobuf"), answer.text
    assert states and states[0] == ("paused_capacity",
                                    f"waiting for the trainer of {BASE_MODEL}: it is running other requests"), states
    assert isinstance(poll_future(server.base_url, busy, "tml-queue-long"), bytes)
