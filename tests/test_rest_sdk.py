"""The RestClient surface through the real tinker SDK: training runs (paginated), checkpoints (list, publish,
unpublish, delete), sessions — and that another key sees none of it (404, never 403)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file, save_file
from tinker import types

from tests.helpers import (
    BASE_MODEL,
    checkpoint_dir,
    forward_logprobs,
    make_datum,
    reference_logprobs,
    reference_peft_model,
)


@pytest.fixture(scope="module")
def tenant(server):
    """A fresh key (its own tenant) with three training runs, the first with two checkpoints."""
    key = "tml-test-rest-a"
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    client.rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    runs = [client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=i).result() for i in range(3)]
    runs[0].forward_backward([make_datum([1, 2, 3], [4, 5])], "cross_entropy").result()
    runs[0].optim_step(types.AdamParams(learning_rate=1e-2)).result()  # weights that differ from the base model
    state = runs[0].save_state("first").result().path
    sampler = runs[0].save_weights_for_sampler("first-sampler").result().path
    yield client, runs, state, sampler
    client.close("success")


@pytest.fixture(scope="module")
def other(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-rest-b")
    client.rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test-rest-b")
    yield client
    client.close("success")


def _status(future) -> int:
    with pytest.raises(tinker.APIStatusError) as info:
        future.result()
    return info.value.status_code


def test_training_runs_paginate_and_describe_their_checkpoints(tenant, server):
    client, runs, state, sampler = tenant
    rest = client.rest
    ids = [r.model_id for r in runs]
    first = rest.list_training_runs(limit=2, offset=0).result()
    second = rest.list_training_runs(limit=2, offset=2).result()
    assert first.cursor.total_count == second.cursor.total_count == 3
    assert [r.training_run_id for r in first.training_runs + second.training_runs] == ids
    run = rest.get_training_run(ids[0]).result()
    assert (run.base_model, run.is_lora, run.lora_rank) == (BASE_MODEL, True, 2)
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler
    listed = rest.list_checkpoints(ids[0]).result().checkpoints
    assert {c.tinker_path for c in listed} == {state, sampler}
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"} and all(c.size_bytes for c in listed)
    assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} == {state, sampler}
    session = rest.get_session(client.holder.get_session_id()).result()
    assert session.training_run_ids == ids
    # SDK 0.39's Checkpoint.base_model (contract/documented.py), on every checkpoint the REST routes return.
    raw = httpx.get(f"{server.base_url}/api/v1/training_runs/{ids[0]}/checkpoints",
                    headers={"X-API-Key": "tml-test-rest-a"}, timeout=30).json()["checkpoints"]
    assert {c["tinker_path"]: c["base_model"] for c in raw} == {state: BASE_MODEL, sampler: BASE_MODEL}
    raw_run = httpx.get(f"{server.base_url}/api/v1/training_runs/{ids[0]}",
                        headers={"X-API-Key": "tml-test-rest-a"}, timeout=30).json()
    assert raw_run["last_checkpoint"]["base_model"] == raw_run["last_sampler_checkpoint"]["base_model"] == BASE_MODEL
    assert client.holder.get_session_id() in rest.list_sessions().result().sessions


def test_other_keys_see_nothing_until_published_and_never_change_it(tenant, other):
    client, runs, _, sampler = tenant
    rest, theirs = client.rest, other.rest
    assert _status(theirs.get_training_run(runs[0].model_id)) == 404
    assert _status(theirs.list_checkpoints(runs[0].model_id)) == 404
    assert _status(theirs.get_session(client.holder.get_session_id())) == 404
    assert theirs.list_training_runs().result().cursor.total_count == 0
    assert _status(theirs.delete_checkpoint_from_tinker_path(sampler)) == 404
    with pytest.raises(tinker.NotFoundError):  # unpublished: not even samplable
        other.create_sampling_client(model_path=sampler).result()

    rest.publish_checkpoint_from_tinker_path(sampler).result()
    assert next(c for c in rest.list_checkpoints(runs[0].model_id).result().checkpoints
                if c.tinker_path == sampler).public
    out = other.create_sampling_client(model_path=sampler).result().sample(
        types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences[0].tokens) == 2  # published: others may sample from it…
    assert _status(theirs.delete_checkpoint_from_tinker_path(sampler)) == 404  # …but not delete it
    assert _status(theirs.unpublish_checkpoint_from_tinker_path(sampler)) == 404
    rest.unpublish_checkpoint_from_tinker_path(sampler).result()
    assert not any(c.public for c in rest.list_checkpoints(runs[0].model_id).result().checkpoints)


@pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning")  # load_state is the simplest way to use a path
def test_deleted_checkpoint_is_gone_with_a_clear_error(tenant):
    client, runs, state, _ = tenant
    rest = client.rest
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert state not in {c.tinker_path for c in rest.list_checkpoints(runs[0].model_id).result().checkpoints}
    with pytest.raises(tinker.RequestFailedError, match="not found"):
        runs[1].load_state(state).result()
    assert _status(rest.delete_checkpoint_from_tinker_path(state)) == 404


def test_weights_info_describes_the_lora_layout(tenant):
    client, _, _, sampler = tenant
    info = client.rest.get_weights_info_by_tinker_path(sampler).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE_MODEL, True, 2)
    assert (info.train_mlp, info.train_attn, info.train_unembed) == (True, True, True)


def test_checkpoints_expire_and_ttls_are_checked(tenant, server):
    client, runs, _, _ = tenant
    rest = client.rest
    short = runs[2].save_weights_for_sampler("short-lived").result().path
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be between"):
        rest.set_checkpoint_ttl_from_tinker_path(short, 11 * 365 * 24 * 3600).result()
    directory = checkpoint_dir(server.data_dir, short)
    assert directory.exists()
    rest.set_checkpoint_ttl_from_tinker_path(short, 4).result()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(runs[2].model_id).result().checkpoints}
    assert listed[short].expires_at is not None
    deadline = time.monotonic() + 20
    while directory.exists() and time.monotonic() < deadline:  # the sweep runs every second on this server
        time.sleep(0.5)
    assert not directory.exists()
    assert short not in {c.tinker_path for c in rest.list_checkpoints(runs[2].model_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        client.create_sampling_client(model_path=short).result()
    kept = runs[2].save_state("kept", ttl_seconds=3600).result().path  # set at save time, then removed again
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
    assert next(c for c in rest.list_checkpoints(runs[2].model_id).result().checkpoints
                if c.tinker_path == kept).expires_at is None


def test_download_round_trip_gives_the_same_logprobs(tenant, tiny_model_dir, other, tmp_path):
    """Signed URLs → plain HTTP → the exported adapter (hosted Tinker's naming: the unembedding LoRA as
    ``model.unembed_tokens``, which tinker-cookbook's merge reads; test_cookbook_weights merges it), whose tensors put
    back in PEFT's naming load on the base model and score like the server."""
    client, runs, _, _ = tenant
    exported = runs[0].save_weights_external("export").result().path
    assert exported.endswith("/external_weights/export")
    response = client.rest.get_external_weights_urls(exported).result()
    assert set(response.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    target = tmp_path / "downloaded"
    target.mkdir()
    for name, url in response.urls.items():
        fetched = httpx.get(url)  # no API key: the signature is the permission
        assert fetched.status_code == 200
        (target / name).write_bytes(fetched.content)
    weights = load_file(target / "adapter_model.safetensors")
    assert "base_model.model.model.unembed_tokens.lora_A.weight" in weights and not any(
        "lm_head" in k or ".embed_tokens." in k for k in weights)
    config = json.loads((target / "adapter_config.json").read_text())
    assert "unembed_tokens" in config["target_modules"]
    # PEFT's naming, by hand: the head's LoRA, and on this tied model the same numbers as the embedding's LoRA.
    head_a, head_b = (weights.pop(f"base_model.model.model.unembed_tokens.lora_{x}.weight") for x in "AB")
    weights |= {"base_model.model.lm_head.lora_A.weight": head_a, "base_model.model.lm_head.lora_B.weight": head_b,
                "base_model.model.model.embed_tokens.lora_embedding_A": head_b.T.contiguous(),
                "base_model.model.model.embed_tokens.lora_embedding_B": head_a.T.contiguous()}
    config["target_modules"] = [m for m in config["target_modules"] if m != "unembed_tokens"] + ["lm_head",
                                                                                                  "embed_tokens"]
    peft_dir = tmp_path / "as-peft"
    peft_dir.mkdir()
    save_file(weights, peft_dir / "adapter_model.safetensors")
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))
    model = reference_peft_model(tiny_model_dir, peft_dir)
    datum = make_datum([1, 2, 3], [4, 5])
    with torch.no_grad():
        expected = reference_logprobs(model, datum).numpy()
        with model.disable_adapter():
            base = reference_logprobs(model, datum).numpy()
    served = forward_logprobs(runs[0], datum)
    np.testing.assert_allclose(served, expected, atol=1e-4)
    assert np.abs(served - base).max() > 1e-3  # the downloaded adapter is the trained one, not a no-op

    url = response.urls["adapter_config.json"]
    tampered = url.replace("adapter_config.json", "adapter_model.safetensors")
    assert httpx.get(tampered).status_code == 403
    assert httpx.get(url.replace("signature=", "signature=0")).status_code == 403
    expired = re.sub(r"expires=\d+", "expires=1000", url)
    assert httpx.get(expired).status_code == 403
    with pytest.raises(tinker.NotFoundError):  # another key cannot ask for URLs to unpublished weights
        other.rest.get_external_weights_urls(exported).result()
    assert exported in {c.tinker_path for c in client.rest.list_checkpoints(runs[0].model_id).result().checkpoints}


def test_copy_weights_makes_an_independent_read_only_copy(tenant, other):
    client, _, _, sampler = tenant
    client.rest.publish_checkpoint_from_tinker_path(sampler).result()
    try:
        copied = other.rest.copy_weights(sampler, "proj-archive").result()  # another key copies a published one
    finally:
        client.rest.unpublish_checkpoint_from_tinker_path(sampler).result()
    assert copied != sampler and copied.endswith("/sampler_weights/first-sampler")
    run_id = copied.split("/")[2]
    assert other.rest.get_training_run(run_id).result().last_sampler_checkpoint.tinker_path == copied
    prompt = types.ModelInput.from_ints([1, 2, 3])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    mine = client.create_sampling_client(model_path=sampler).result().sample(prompt, 1, greedy).result()
    theirs = other.create_sampling_client(model_path=copied).result().sample(prompt, 1, greedy).result()
    assert theirs.sequences[0].tokens == mine.sequences[0].tokens  # the same weights
    with pytest.raises(tinker.NotFoundError):  # unpublished again: no further copies
        other.rest.copy_weights(sampler, "proj-archive").result()
    client.rest.delete_checkpoint_from_tinker_path(sampler).result()  # the owner's delete leaves the copy intact
    again = other.create_sampling_client(model_path=copied).result().sample(prompt, 1, greedy).result()
    assert again.sequences[0].tokens == mine.sequences[0].tokens


def test_the_sdk_cli_lists_and_downloads(server, tmp_path):
    """The SDK's own ``tinker`` command: list runs and checkpoints, and ``checkpoint download`` (which loads the
    training checkpoint into a new run, exports it with save_weights_external, fetches the signed URLs and deletes
    the export) giving a PEFT directory."""
    key = "tml-test-cli"
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    run = client.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
    state = run.save_state("cli").result().path
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": key}
    cli = [str(Path(sys.executable).with_name("tinker")), "--format", "json"]

    def tinker_cli(*args: str) -> dict:
        done = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert run.model_id in json.dumps(tinker_cli("run", "list"))
    assert state in json.dumps(tinker_cli("checkpoint", "list", "--run-id", run.model_id))
    tinker_cli("checkpoint", "download", state, "--output", str(tmp_path))
    (downloaded,) = tmp_path.iterdir()
    assert {f.name for f in downloaded.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    kinds = {c.checkpoint_type for c in rest.list_user_checkpoints().result().checkpoints}
    assert kinds == {"training"}  # the temporary export was deleted again
    client.close("success")
