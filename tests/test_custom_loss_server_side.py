"""Server-side custom losses through the real SDK: ``create_custom_loss`` uploads the traced loss and
``forward_backward_custom`` runs it in the trainer in one request. Same loss, same data, same start: the server-side
path must give the client-side path's loss, metrics, logprobs and gradient (the SDK's own fallback, which a server
started with ``--client-side-custom-losses`` makes it take)."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from tinker import types

from compat_server.training.custom_losses import CustomLossStore
from shims.custom_loss.graph import CustomLossLimits, compile_custom_loss
from shims.errors import UserError
from tests.helpers import BASE_MODEL, MAIN_KEY, expect_user_error

KEY = MAIN_KEY
RANKS = {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_logprobs": 1, "beta": 0}


def dpo(logprobs, chosen_mask, rejected_mask, ref_logprobs, beta):
    """DPO on a pair packed in one datum: the chosen and the rejected completion each marked by a mask, against the
    reference model's logprobs of the same tokens."""
    policy = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum()
    reference = (ref_logprobs * chosen_mask).sum() - (ref_logprobs * rejected_mask).sum()
    margin = beta * (policy - reference)
    return -F.logsigmoid(margin), {"custom/dpo_accuracy:mean": (margin > 0).float(),
                                   "custom/dpo_margin:mean": margin.detach(),
                                   "custom/chosen_tokens:sum": chosen_mask.sum()}


def dpo_batch(reference_client, pairs: int = 4) -> list[types.Datum]:
    rng = np.random.default_rng(20)
    data = []
    for _ in range(pairs):
        prompt, chosen, rejected = (rng.integers(0, 500, size=k).tolist() for k in (5, 4, 6))
        tokens = prompt + chosen + rejected
        n = len(tokens) - 1
        chosen_mask = np.zeros(n, np.float32)
        chosen_mask[len(prompt) - 1:len(prompt) - 1 + len(chosen)] = 1
        rejected_mask = np.zeros(n, np.float32)
        rejected_mask[len(prompt) - 1 + len(chosen):] = 1
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64),
                                            "weights": np.zeros(n, np.float32)})
        data.append((datum, chosen_mask, rejected_mask))
    forward = reference_client.forward([d for d, _, _ in data], "cross_entropy").result()
    out = []
    for (datum, chosen_mask, rejected_mask), ref in zip(data, forward.loss_fn_outputs):
        ref_logprobs = ref["logprobs"].to_numpy() + rng.normal(scale=0.3, size=len(chosen_mask)).astype(np.float32)
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"], "chosen_mask": chosen_mask,
            "rejected_mask": rejected_mask, "ref_logprobs": ref_logprobs.astype(np.float32),
            "beta": types.TensorData(data=[0.5], dtype="float32", shape=[])}))
    return out


@pytest.fixture(scope="module")
def dpo_handle(service_client):
    return service_client.create_custom_loss(dpo, RANKS).result()


def test_dpo_runs_on_the_server_and_equals_the_client_side_path(service_client, server, dpo_handle):
    assert service_client.holder.get_client_config().custom_loss_server_side
    assert dpo_handle.loss_id is not None, "the SDK should have uploaded the loss (custom_loss_server_side=true)"
    client_side = dataclasses.replace(dpo_handle, loss_id=None)  # what the SDK holds when the server says false
    server_client, local_client, reference = (
        service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=13).result()
        for _ in range(3))
    data = dpo_batch(reference)
    adam = types.AdamParams(learning_rate=5e-3)
    for step in range(2):  # the second step starts from moved weights, so LoRA A and B both get gradients
        remote = server_client.forward_backward_custom(data, dpo_handle).result()
        local = local_client.forward_backward_custom(data, client_side).result()
        # One server request: no surrogate pass, so the metrics are the loss's own plus loss:sum.
        assert set(remote.metrics) == {"loss:sum", "custom/dpo_accuracy:mean", "custom/dpo_margin:mean",
                                       "custom/chosen_tokens:sum"}
        assert set(local.metrics) == set(remote.metrics) | {"surrogate_loss:sum"}
        for key, value in remote.metrics.items():
            assert value == pytest.approx(local.metrics[key], rel=1e-5, abs=1e-6), key
        assert remote.metrics["custom/chosen_tokens:sum"] == 16
        assert remote.metrics["loss:sum"] > 0 and (step == 0 or remote.metrics["custom/dpo_margin:mean"] != 0)
        for a, b in zip(remote.loss_fn_outputs, local.loss_fn_outputs):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
        norms = [c.optim_step(adam).result().metrics["grad_norm"] for c in (server_client, local_client)]
        assert norms[0] > 0 and norms[0] == pytest.approx(norms[1], rel=1e-5)
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": d.loss_fn_inputs["chosen_mask"]}) for d in data]
    after = [[o["logprobs"].to_numpy() for o in c.forward(plain, "cross_entropy").result().loss_fn_outputs]
             for c in (server_client, local_client)]
    before = [o["logprobs"].to_numpy() for o in reference.forward(plain, "cross_entropy").result().loss_fn_outputs]
    for a, b, old in zip(after[0], after[1], before):
        assert np.abs(a - old).max() > 1e-3  # the steps moved the model…
        np.testing.assert_allclose(a, b, atol=1e-5)  # …identically on both paths
    assert f"forward_backward done: {server_client.model_id}" in server.log()
    assert "custom loss created" in server.log()


def test_a_loss_id_works_only_for_its_key_and_session(service_client, server, dpo_handle):
    mine = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    data = dpo_batch(mine, pairs=1)
    config = {"loss_id": dpo_handle.loss_id}
    assert mine.forward_backward(data, "custom", config).result().metrics["loss:sum"] > 0  # the raw form works
    other_key = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-custom-loss-thief")
    other_session = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    try:
        thief = other_key.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
        expect_user_error(thief.forward_backward(data, "custom", config), "unknown loss_id")
        neighbour = other_session.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
        expect_user_error(neighbour.forward_backward(data, "custom", config), "belongs to session")
        with pytest.raises(ValueError, match="only be used by clients of that session"):  # the SDK checks too
            neighbour.forward_backward_custom(data, dpo_handle)
    finally:
        other_key.close("success")
        other_session.close("success")
    expect_user_error(mine.forward_backward(data, "custom", {}), "exactly one loss_fn_config key, loss_id")
    expect_user_error(mine.forward_backward(data, "custom", {"loss_id": "nope"}), "unknown loss_id")
    # A datum without an input the loss reads, sent raw: a user error in its turn, and the client goes on.
    short = [types.Datum(model_input=d.model_input, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                                                    if k != "beta"}) for d in data]
    expect_user_error(mine.forward_backward(short, "custom", config), "has no loss_fn_inputs['beta']")
    assert mine.forward_backward(data, "custom", config).result().metrics["loss:sum"] > 0


def out_of_range(logprobs, weights):
    return -(logprobs[40] * weights[40]), {}


def outer_loss(logprobs, weights):
    return -torch.outer(logprobs, weights).sum(), {}


def test_losses_the_server_will_not_run_are_user_errors(service_client, server):
    # The SDK allows any torch function; this server does not run torch.outer (it makes T x T values).
    with pytest.raises(tinker.BadRequestError, match="'torch.outer' is not a function this server runs"):
        service_client.create_custom_loss(outer_loss, {"logprobs": 1, "weights": 1}).result()
    # A loss that fails while running fails its own request only; the client keeps training.
    handle = service_client.create_custom_loss(out_of_range, {"logprobs": 1, "weights": 1}).result()
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 9))),
                        loss_fn_inputs={"target_tokens": np.arange(2, 10), "weights": np.ones(8, np.float32)})
    expect_user_error(client.forward_backward_custom([datum], handle), "custom loss 'out_of_range'",
                      "failed: IndexError")
    assert client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0

    # Hand-written graphs reach the same checks (the SDK never sends these).
    session = service_client.holder.get_session_id()

    def create(nodes, session_id=session, key=KEY):
        return httpx.post(f"{server.base_url}/api/v1/create_custom_loss", headers={"X-API-Key": key}, timeout=30,
                          json={"session_id": session_id, "custom_loss_seq_id": 10_000, "name": "hostile",
                                "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"nodes": nodes}})

    x = {"ref": "logprobs"}
    placeholder = {"op": "placeholder", "name": "logprobs", "target": "logprobs"}
    sneaky = [placeholder, {"op": "call_function", "name": "c", "target": "getattr", "args": [x, "__class__"]},
              {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": "c"}, {"dict": {}}]}]}]
    answer = create(sneaky)
    assert answer.status_code == 400 and answer.json()["category"] == "user"
    assert "only the attributes" in answer.json()["error"]
    evil = [placeholder, {"op": "call_function", "name": "e", "target": "builtins.eval", "args": ["1"]}]
    assert "is not a function this server runs" in create(evil).json()["error"]
    for depth in (20, 100_000):  # nested past the limit; past what a recursive reader could take
        nested = "[" * depth + "]" * depth
        deep = ('{"session_id": "' + session + '", "custom_loss_seq_id": 1, "name": "deep", "inputs": [{"name": '
                '"logprobs", "rank": 1}], "graph": {"nodes": [{"op": "placeholder", "name": "logprobs", "target": '
                '"logprobs"}, {"op": "call_function", "name": "a", "target": "torch.add", "args": [' + nested + ']}]}}')
        answer = httpx.post(f"{server.base_url}/api/v1/create_custom_loss", content=deep, timeout=30,
                            headers={"X-API-Key": KEY, "Content-Type": "application/json"})
        assert answer.status_code == 400 and "nest" in answer.json()["error"], answer.text
    assert create(sneaky, session_id="no-such-session").status_code == 404
    assert create(sneaky, key="tml-test-custom-loss-thief").status_code == 404  # another key's session


def test_the_store_reuses_an_id_on_retry_and_drops_a_finished_session():
    store = CustomLossStore()
    loss = compile_custom_loss("l", [types.CustomLossInput(name="logprobs", rank=1)], [
        types.CustomLossNode(op="placeholder", name="logprobs", target="logprobs"),
        types.CustomLossNode(op="call_method", name="s", target="sum", args=[{"ref": "logprobs"}]),
        types.CustomLossNode(op="output", name="output", target="output",
                             args=[{"tuple": [{"ref": "s"}, {"dict": {}}]}])], CustomLossLimits())
    loss_id = store.add("alice", "s1", 0, loss, "d", max_per_key=2)
    assert store.add("alice", "s1", 0, loss, "d", max_per_key=2) == loss_id
    with pytest.raises(UserError, match="already names another"):
        store.add("alice", "s1", 0, loss, "other", max_per_key=2)
    store.add("alice", "s2", 0, loss, "d", max_per_key=2)
    with pytest.raises(UserError, match="--max-custom-losses-per-key 2"):
        store.add("alice", "s3", 0, loss, "d", max_per_key=2)
    assert store.resolve("alice", "s1", {"loss_id": loss_id}) is loss
    with pytest.raises(UserError, match="unknown loss_id"):
        store.resolve("bob", "s1", {"loss_id": loss_id})
    assert store.drop_session("s1") == 1
    with pytest.raises(UserError, match="unknown loss_id"):
        store.resolve("alice", "s1", {"loss_id": loss_id})


@pytest.fixture(scope="module")
def client_side_server(model_cache, tmp_path_factory):
    from tests.server import start_server

    running = start_server(tmp_path_factory.mktemp("client-side-losses"), "--client-side-custom-losses")
    yield running
    running.stop()


def test_with_the_flag_off_custom_losses_run_client_side(client_side_server):
    service = tinker.ServiceClient(base_url=client_side_server.base_url, api_key=KEY)
    try:
        assert not service.holder.get_client_config().custom_loss_server_side
        handle = service.create_custom_loss(dpo, RANKS).result()
        assert handle.loss_id is None  # the SDK keeps it client-side
        client = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=13).result()
        result = client.forward_backward_custom(dpo_batch(client, pairs=2), handle).result()
        assert "surrogate_loss:sum" in result.metrics and "custom/dpo_margin:mean" in result.metrics
        answer = httpx.post(f"{client_side_server.base_url}/api/v1/create_custom_loss", headers={"X-API-Key": KEY},
                            json={"session_id": service.holder.get_session_id(), "custom_loss_seq_id": 5,
                                  "name": "x", "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"nodes": []}})
        assert answer.status_code == 400 and "--client-side-custom-losses" in answer.json()["error"]
    finally:
        service.close("success")
