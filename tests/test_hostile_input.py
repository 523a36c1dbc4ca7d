"""Hostile names and paths: checkpoint names and tinker:// paths that try to leave their directory, on every route that
takes one. Each is refused with a clear error in the caller's SDK shape; nothing is written or read outside the
checkpoint store, and the checkpoint that was there is unchanged. (The property-based fuzz run is in test_fuzz.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest
import tinker

from tests.helpers import BASE_MODEL, MAIN_KEY, checkpoint_dir, make_datum, train, tree_digest

NAMES = ["../escape", "a/b", "..", ".", "bad\x00name", "x" * 300, "-leading-dash", "sp ace"]


@pytest.fixture(scope="module")
def saved(service_client):
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=5).result()
    train(client, make_datum([3, 4], [5, 6]), 1)
    return client, client.save_state("good").result().path


def test_checkpoint_names_that_leave_their_directory_are_refused(saved, server):
    client, good = saved
    run_dir = checkpoint_dir(server.data_dir, good).parents[2]
    before = tree_digest(run_dir)
    for name in NAMES:
        for save in (client.save_state, client.save_weights_for_sampler):
            with pytest.raises(tinker.RequestFailedError, match="invalid checkpoint name") as failure:
                save(name).result()
            assert failure.value.category == tinker.types.RequestErrorCategory.User
    assert tree_digest(run_dir) == before
    assert not list(server.data_dir.parent.glob("escape*"))  # nothing landed beside the data directory either
    assert client.save_state("still-fine").result().path.endswith("/weights/still-fine")


def test_tinker_paths_that_leave_their_directory_are_refused_everywhere(saved, service_client, server):
    good = saved[1]
    run = good.split("/")[2]
    evil = [f"tinker://{run}/weights/../../../etc", f"tinker://{run}/weights/good/../good", "tinker://../../weights/x",
            f"tinker://{run}/weights/%2e%2e", f"tinker://{run}/weights/..", "file:///etc/passwd",
            f"tinker://{run}/sampler_weights/../weights/good"]
    before = checkpoint_dir(server.data_dir, good)
    digest = tree_digest(before)
    headers = {"X-API-Key": MAIN_KEY}
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=MAIN_KEY, max_retries=0)
    for path in evil:
        with pytest.raises(tinker.RequestFailedError) as failure:
            service_client.create_training_client_from_state(path).result()
        assert failure.value.category == tinker.types.RequestErrorCategory.User, path
        refusals = (tinker.BadRequestError, tinker.NotFoundError)
        if not path.startswith("tinker://"):
            refusals = ValueError  # the SDK itself refuses to send it
        with pytest.raises(refusals):
            service_client.create_sampling_client(model_path=path).result()
        with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
            chat.chat.completions.create(model=path, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        info = httpx.post(f"{server.base_url}/api/v1/weights_info", headers=headers, json={"tinker_path": path})
        assert info.status_code in (400, 404) and info.json()["category"] == "user", (path, info.text)
    assert tree_digest(before) == digest
    resumed = service_client.create_training_client_from_state(good).result()  # the real one still loads
    train(resumed, make_datum([3, 4], [5, 6]), 1)
