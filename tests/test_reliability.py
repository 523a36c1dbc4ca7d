"""Crash recovery and session expiry, against real server processes.

``kill -9`` the server in the middle of training, start a new one on the same data directory, and check what users
rely on: everything written before the crash is listed, finished results are still there, requests that were running
fail clearly as server errors, a checkpoint resumes exactly, and a half-written checkpoint never appears.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import psutil
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.helpers import (
    ADAM,
    BASE_MODEL,
    MAIN_KEY,
    checkpoint_dir,
    crash_the_trainer,
    forward_logprobs,
    make_datum,
    poll_future,
    train,
)
from tests.server import start_server

KEY = "tml-test-crash"
HEADERS = {"X-API-Key": KEY}


def kill_9(server) -> None:
    """SIGKILL the server alone, as the OOM killer or an operator would. Every process it started (its private Ray
    instance) must end on its own within seconds: once, Ray's agents lived on for a minute or more."""
    tree = psutil.Process(server.process.pid).children(recursive=True)
    names = {p.pid: " ".join(p.cmdline())[:80] for p in tree}
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    alive = psutil.wait_procs(tree, timeout=15)[1]
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"outlived the killed server by 15 s: {[names[p.pid] for p in alive]}"


@pytest.mark.timeout(600)
def test_kill_9_mid_training_loses_nothing_that_was_written(model_cache, tmp_path):
    data_dir = tmp_path / "data"
    server = start_server(data_dir)
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        client = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
        run_id = client.model_id
        datum = make_datum([11, 42, 77, 103], [250, 3, 99])
        train(client, datum, 3)
        state = client.save_state("before-crash").result().path
        sampler_path = client.save_weights_for_sampler("before-crash").result().path
        # Written after its turn in the run's order, but answered only once durable: its files are in place now.
        assert {"adapter_model.safetensors", "adapter_config.json"} <= {
            p.name for p in checkpoint_dir(data_dir, sampler_path).iterdir()}
        # What the step after the checkpoint does, to check exact resumption against.
        expected_loss = client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        client.optim_step(ADAM).result()
        expected_logprobs = forward_logprobs(client, datum)

        def asample(max_tokens: int) -> str:
            body = {"num_samples": 1, "base_model": BASE_MODEL, "sampling_params": {"max_tokens": max_tokens, "stop": []},
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}
            return httpx.post(f"{server.base_url}/api/v1/asample", headers=HEADERS, json=body).json()["request_id"]

        finished = asample(2)
        _result(server.base_url, finished)  # complete before the server dies (one long-poll may say try again)
        in_flight = [asample(1500) for _ in range(4)]  # long enough to be running when the server dies
        time.sleep(0.5)
        client.save_weights_for_sampler("at-crash")  # the kill comes as it is handed over or written, or after
        half_written = data_dir / "checkpoints" / run_id / "weights" / "torn" / ".staging-0000"
        half_written.mkdir(parents=True)
        (half_written / "adapter_model.safetensors").write_bytes(b"torn")
    finally:
        kill_9(server)

    server = start_server(data_dir)  # the same data directory, a new process
    try:
        assert "requests in flight (now failed)" in server.log() and not half_written.exists()
        rest = tinker.RestClient(base_url=server.base_url, api_key=KEY)
        assert run_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
        at_crash = sampler_path.replace("before-crash", "at-crash")
        assert listed - {at_crash} == {state, sampler_path}  # the torn one never appears
        assert not list((data_dir / "checkpoints").rglob(".staging-*"))  # nor what the crash left half written
        if at_crash in listed:  # its files were durable before the kill: whole
            assert (checkpoint_dir(data_dir, at_crash) / "adapter_model.safetensors").stat().st_size > 0
        assert rest.list_sessions().result().sessions

        def retrieve(request_id: str) -> httpx.Response:
            return httpx.post(f"{server.base_url}/api/v1/retrieve_future", headers=HEADERS, timeout=60,
                              json={"request_id": request_id})

        done = retrieve(finished)
        assert done.status_code == 200 and done.headers["content-type"].startswith("application/x-protobuf")
        for request_id in in_flight:
            failed = retrieve(request_id).json()
            assert failed["category"] == "server" and "restarted" in failed["error"]

        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        loss = resumed.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        resumed.optim_step(ADAM).result()
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        np.testing.assert_allclose(forward_logprobs(resumed, datum), expected_logprobs, atol=1e-6)
        sampler = service.create_sampling_client(model_path=sampler_path).result()
        assert sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
        if at_crash in listed:
            sampler = service.create_sampling_client(model_path=at_crash).result()
            assert sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
        service.close("success")
    finally:
        server.stop()


def _result(url: str, request_id: str, key: str = KEY) -> dict | bytes:
    return poll_future(url, request_id, key)


@pytest.mark.timeout(300)
def test_sessions_that_stop_heartbeating_expire_and_their_models_unload(model_cache, tmp_path):
    """A client that dies mid-training stops heartbeating: after --session-timeout its session ends and its model
    leaves the trainer (requests on it fail clearly), but what it saved stays, and a new client resumes from it."""
    server = start_server(tmp_path / "data", "--session-timeout", "3", "--expiry-sweep-seconds", "1")
    try:
        url = server.base_url
        session = httpx.post(f"{url}/api/v1/create_session", headers=HEADERS, json={
            "tags": [], "user_metadata": {}, "sdk_version": "raw-http", "type": "create_session"}).json()["session_id"]

        alive = threading.Event()
        alive.set()

        def heartbeat() -> None:  # as the SDK's background thread does, however long each step takes here
            while alive.is_set():
                httpx.post(f"{url}/api/v1/session_heartbeat", headers=HEADERS, json={"session_id": session})
                time.sleep(0.5)

        beating = threading.Thread(target=heartbeat, daemon=True)
        beating.start()
        created = httpx.post(f"{url}/api/v1/create_model", headers=HEADERS, json={
            "session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 2},
            "type": "create_model"}).json()
        model_id = _result(url, created["request_id"])["model_id"]
        saved = httpx.post(f"{url}/api/v1/save_weights", headers=HEADERS, json={
            "model_id": model_id, "path": "kept", "seq_id": 1, "type": "save_weights"}).json()
        state = _result(url, saved["request_id"])["path"]
        alive.clear()
        beating.join()
        assert httpx.post(f"{url}/api/v1/session_heartbeat", headers=HEADERS,
                          json={"session_id": session}).status_code == 200  # the session was kept alive until now
        deadline = time.monotonic() + 60  # …and then no more heartbeats
        while f"session expired: {session}" not in server.log():
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.5)
        expired = next(line for line in server.log().splitlines() if f"session expired: {session}" in line)
        assert f"models unloaded: {model_id}" in expired
        request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[make_datum([1, 2, 3], [4, 5])], loss_fn="cross_entropy"), model_id=model_id, seq_id=2)
        future = httpx.post(f"{url}/api/v1/forward_backward", headers={**HEADERS,
                                                                        "Content-Type": "application/x-protobuf"},
                            content=forward_backward_request_to_proto(request).SerializeToString()).json()
        failed = _result(url, future["request_id"])
        assert failed["category"] == "user" and "session expired" in failed["error"]
        assert httpx.post(f"{url}/api/v1/session_heartbeat", headers=HEADERS,
                          json={"session_id": session}).status_code == 410  # tells the SDK's loop to stop
        service = tinker.ServiceClient(base_url=url, api_key=KEY)  # the checkpoint stayed: a new client resumes
        resumed = service.create_training_client_from_state(state).result()
        loss = resumed.forward_backward([make_datum([1, 2, 3], [4, 5])], "cross_entropy").result()
        assert np.isfinite(loss.metrics["loss:sum"])
        service.close("success")
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_per_key_limits_refuse_clearly_and_both_sdks_retry(model_cache, tmp_path):
    """--max-pending-per-key counts Tinker futures and OpenAI completions of a key together: over it, 429 with
    Retry-After in each API's error shape, which both SDKs honour; other keys are not held back.
    --max-adapters-per-key refuses a further training run with a clear error until one is unloaded."""
    server = start_server(tmp_path / "data", "--max-pending-per-key", "2", "--max-adapters-per-key", "2")
    try:
        url = server.base_url

        def asample(key: str, max_tokens: int) -> httpx.Response:
            return httpx.post(f"{url}/api/v1/asample", headers={"X-API-Key": key}, json={
                "num_samples": 1, "base_model": BASE_MODEL,
                "sampling_params": {"max_tokens": max_tokens, "stop": []},
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}, timeout=60)

        def chat(key: str, max_tokens: int) -> httpx.Response:
            # Answered once sampled, beside the two long requests on 2 busy cores: httpx's 5 s default is too short.
            return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
                "model": BASE_MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]},
                timeout=60)

        running = [asample(KEY, 1500).json()["request_id"] for _ in range(2)]
        refused = asample(KEY, 2)
        assert refused.status_code == 429 and float(refused.headers["Retry-After"]) > 0
        assert refused.json()["category"] == "user" and "--max-pending-per-key 2" in refused.json()["error"]
        refused = chat(KEY, 2)  # the same count covers the OpenAI routes, answered in OpenAI's shape
        assert refused.status_code == 429 and float(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "--max-pending-per-key 2" in refused.json()["error"]["message"]
        assert asample("tml-test-someone-else", 2).status_code == 200  # other keys are not held back
        assert chat("tml-test-someone-else", 2).status_code == 200
        for request_id in running:
            _result(url, request_id)
        room = asample(KEY, 2)  # room again once they finished
        assert room.status_code == 200
        _result(url, room.json()["request_id"])  # and once it has finished too, it no longer counts

        # Open OpenAI streams hold the key's count too: Tinker requests wait for them.
        openai_client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        streams = [openai_client.chat.completions.create(  # ignore_eos: still running when the next requests come
            model=BASE_MODEL, max_tokens=1500, stream=True, messages=[{"role": "user", "content": "hi"}],
            extra_body={"ignore_eos": True}) for _ in range(2)]
        for stream in streams:
            next(iter(stream))  # the stream has started
        assert asample(KEY, 2).status_code == 429
        with pytest.raises(openai.RateLimitError, match="max-pending-per-key"):
            openai_client.chat.completions.create(model=BASE_MODEL, max_tokens=2, stream=True,
                                                  messages=[{"role": "user", "content": "hi"}])
        for stream in streams:
            assert sum(1 for _ in stream) > 0
        assert asample(KEY, 2).status_code == 200  # streams that ended gave their count back

        # Both SDKs honour 429 + Retry-After: more concurrent requests than the limit all complete.
        service = tinker.ServiceClient(base_url=url, api_key="tml-test-limited-sdk")
        sampler = service.create_sampling_client(base_model=BASE_MODEL).result()
        params = types.SamplingParams(max_tokens=64, stop=[], seed=1)
        futures = [sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params) for _ in range(6)]
        assert all(len(f.result().sequences[0].tokens) == 64 for f in futures)
        retrying = openai.OpenAI(base_url=f"{url}/v1", api_key="tml-test-limited-sdk", max_retries=20)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: retrying.chat.completions.create(
                model=BASE_MODEL, max_tokens=32, messages=[{"role": "user", "content": "hi"}]), range(6)))
        assert all(answer.usage.completion_tokens > 0 for answer in answers)
        usage = httpx.get(f"{url}/api/v1/metrics", headers={"X-API-Key": "tml-test-limited-sdk"}).json()["requests"]
        assert usage["pending"] == 0 and usage["limit"] == 2
        assert usage["refused"] > 0  # the SDKs did meet 429s, and retried past them

        # --max-adapters-per-key: a third loaded run is refused; unloading one makes room.
        first, second = (service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
                         for _ in range(2))
        with pytest.raises(tinker.RequestFailedError, match="--max-adapters-per-key 2"):
            service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        other = tinker.ServiceClient(base_url=url, api_key="tml-test-someone-else")
        other.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()  # another key's runs do not count
        unloaded = httpx.post(f"{url}/api/v1/unload_model", headers={"X-API-Key": "tml-test-limited-sdk"},
                              json={"model_id": first.model_id}).json()
        assert _result(url, unloaded["request_id"], "tml-test-limited-sdk")["type"] == "unload_model"
        third = service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        train(third, make_datum([1, 2, 3], [4, 5]), 1)
        train(second, make_datum([1, 2, 3], [4, 5]), 1)
        service.close("success")
        other.close("success")
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_a_crashed_trainer_restarts_and_saved_runs_come_back(model_cache, tmp_path):
    """kill -9 the trainer actor under a running request: that request fails saying so, the pool starts the trainer
    again, and every active run is reloaded from its latest training checkpoint (steps after it are lost); a run
    that never saved is marked unloaded, clearly (``tests.helpers.crash_the_trainer``)."""
    server = start_server(tmp_path / "data")
    try:
        url = server.base_url
        saved, _ = crash_the_trainer(server, KEY, lambda trainer: (trainer["pid"], "its process"))
        runs = httpx.get(f"{url}/api/v1/dashboard", headers=HEADERS).json()["training_runs"]
        assert "last-good" in next(r for r in runs if r["id"] == saved.model_id)["rolled_back"]
        metrics = httpx.get(f"{url}/api/v1/metrics", headers=server.admin).json()

        # A crashed sampler replica comes back too, and loads adapters again on demand.
        sampler = saved.save_weights_and_get_sampling_client().result()
        greedy = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
        before = sampler.sample(types.ModelInput.from_ints([11, 42, 77, 103]), 1, greedy).result()
        (replica,) = metrics["sampling"][BASE_MODEL]["replicas"]
        psutil.Process(replica["pid"]).kill()
        deadline = time.monotonic() + 120
        while True:
            try:
                after = sampler.sample(types.ModelInput.from_ints([11, 42, 77, 103]), 1, greedy).result()
                break
            except tinker.RequestFailedError as exc:  # the calls that met the dead replica fail as server errors
                assert exc.category == types.RequestErrorCategory.Server and time.monotonic() < deadline
                time.sleep(1)
        assert after.sequences[0].tokens == before.sequences[0].tokens
    finally:
        server.stop()


def test_a_full_disk_while_saving_says_so_and_the_run_goes_on(server, service_client):
    """Once, a full disk reached the client as "ActorUnavailable … [enforce fail at inline_container.cc]". The
    run's checkpoint directory is put on a 16 KiB tmpfs: the save fails naming the disk and the checkpoint, leaves
    nothing behind, and the run trains and saves on once there is room again."""
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    datum = make_datum([1, 2, 3], [4, 5])
    train(client, datum, 1)
    weights_dir = server.data_dir / "checkpoints" / client.model_id / "weights"
    weights_dir.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(weights_dir)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"this test fills a real 16 KiB filesystem and needs `mount -t tmpfs` (root): {mounted.stderr}")
    try:
        with pytest.raises(tinker.RequestFailedError) as failure:
            client.save_state("full").result()
        message = str(failure.value)
        assert failure.value.category == types.RequestErrorCategory.Server
        assert f"no space left on device while saving tinker://{client.model_id}/weights/full" in message
        assert "ActorUnavailable" not in message and "enforce fail" not in message
        assert not [p for p in weights_dir.rglob("*") if p.is_file()]  # the half-written save is gone
        rest = tinker.RestClient(base_url=server.base_url, api_key=MAIN_KEY)
        assert not rest.list_checkpoints(client.model_id).result().checkpoints
        train(client, datum, 1)  # the trainer is fine
    finally:
        subprocess.run(["umount", str(weights_dir)], check=True)
    assert client.save_state("with-room").result().path.endswith("/weights/with-room")
