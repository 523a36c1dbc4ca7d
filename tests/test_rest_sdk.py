"""The RestClient surface through the real tinker SDK: training runs (paginated), checkpoints (list, publish,
unpublish, delete), sessions — and that another key sees none of it (404, never 403)."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL, make_datum


@pytest.fixture(scope="module")
def tenant(server):
    """A fresh key (its own tenant) with three training runs, the first with two checkpoints."""
    key = "tml-test-rest-a"
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    client.rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    runs = [client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=i).result() for i in range(3)]
    runs[0].forward_backward([make_datum([1, 2, 3], [4, 5])], "cross_entropy").result()
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


def test_training_runs_paginate_and_describe_their_checkpoints(tenant):
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
