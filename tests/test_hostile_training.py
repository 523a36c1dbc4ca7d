"""Issue 31's hostile tenants on the training side, against the real server: a tenant whose custom loss breaks the
shared trainer batch (rows 1 and 2), builds values that are huge written out (row 4), is stored with a million
arguments (row 6) or indexes with a Python list (row 7). Each test asserts what the attacker gets — a user error,
at once — and what the honest tenant beside it gets: exactly what it gets when it runs alone.

The tenants are keys of the shared open server. To make the attacker and the victim share a trainer batch, a third
tenant's long forward pass runs first: requests that arrive while the trainer is busy go to it together."""

from __future__ import annotations

import operator

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL, create_doubled, make_datum

ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def tenants(server):
    """Service clients of four tenants: ``victim``, its ``twin`` (the same requests, run alone, as the reference),
    ``attacker`` and ``slow`` (the long forward pass that makes the others queue into one batch)."""
    clients = {role: tinker.ServiceClient(base_url=server.base_url, api_key=f"tml-hostile-{role}")
               for role in ("victim", "twin", "attacker", "slow")}
    yield clients
    for client in clients.values():
        client.close("success")


def on_meta(logprobs):
    return logprobs.to("meta").sum(), {}  # passes every check made before it runs; its value is on no device


def floor_divided(logprobs):
    return operator.floordiv(logprobs, logprobs).sum(), {}  # runs forward; its backward raises


def victim_data() -> list[types.Datum]:
    return [make_datum([3, 4, 5, 6], [7, 8, 9]), make_datum([10, 11], [12, 13, 14, 15])]


def slow_data() -> list[types.Datum]:
    rng = np.random.default_rng(0)
    return [make_datum(rng.integers(0, 400, 1000).tolist(), rng.integers(0, 400, 999).tolist()) for _ in range(12)]


def batch_counts(server) -> dict:
    return httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin, timeout=30).json()["training"][
        BASE_MODEL]


def logprobs_of(result) -> list[np.ndarray]:
    return [output["logprobs"].to_numpy() for output in result.loss_fn_outputs]


@pytest.mark.parametrize("hostile, why", [(on_meta, "made a tensor on device meta"),
                                          (floor_divided, "failed: RuntimeError: derivative for aten::floor_divide"),
                                          ("doubled", "nested deeper than 8 levels (--custom-loss-max-nesting)")],
                         ids=["wrong-device", "backward-raises", "doubled-tuples"])
def test_a_custom_loss_that_breaks_the_shared_batch_fails_alone(tenants, server, hostile, why):
    """Rows 1, 2 and 4: the attacker's forward_backward shares a trainer batch with the victim's forward_backward,
    then with the victim's optim_step. The attacker gets a user error saying why (row 4's loss: refused by the
    bound on nesting after its ninth step, not after walking 2**24 leaves); the victim's loss, logprobs, optimizer step
    (applied once, reported applied) and the weights after it equal those of its twin, which ran alone."""
    data = victim_data()
    twin = tenants["twin"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=31)
    alone = [twin.forward_backward(data, "cross_entropy").result(), twin.optim_step(ADAM).result(),
             twin.forward(data, "cross_entropy").result()]

    victim = tenants["victim"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=31)
    attacker = tenants["attacker"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=32)
    slow = tenants["slow"].create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=33)
    if hostile == "doubled":
        loss_id = create_doubled(server, tenants["attacker"].holder.get_session_id())
    else:
        loss_id = tenants["attacker"].create_custom_loss(hostile, {"logprobs": 1}).result().loss_id
    name = getattr(hostile, "__name__", hostile)
    before = batch_counts(server)
    together = []
    for victim_call in (lambda: victim.forward_backward(data, "cross_entropy"), lambda: victim.optim_step(ADAM)):
        long_pass = slow.forward(slow_data(), "cross_entropy")
        attack = attacker.forward_backward(victim_data(), "custom", {"loss_id": loss_id})
        honest = victim_call()
        with pytest.raises(tinker.RequestFailedError) as failure:
            attack.result()
        assert failure.value.category == tinker.types.RequestErrorCategory.User
        assert f"custom loss {name!r}" in str(failure.value) and why in str(failure.value)
        together.append(honest.result())
        long_pass.result()
    together.append(victim.forward(data, "cross_entropy").result())
    after = batch_counts(server)
    assert after["requests"] - before["requests"] > after["batches"] - before["batches"], "no batch was shared"

    assert together[0].metrics["loss:sum"] == pytest.approx(alone[0].metrics["loss:sum"], rel=1e-6)
    for x, y in zip(logprobs_of(together[0]), logprobs_of(alone[0]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)
    assert together[1].metrics == pytest.approx(alone[1].metrics, rel=1e-5)  # the same gradient, stepped once
    for x, y in zip(logprobs_of(together[2]), logprobs_of(alone[2]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_a_huge_custom_loss_is_refused_before_it_is_read(tenants, server):
    """Row 6: a stored loss whose node takes 100,000 references as its arguments (each once counted as nothing) and
    one of a million (a 20 MiB body) are refused with a user error naming the limit; the attacker's next, honest
    loss is still taken."""
    session = tenants["attacker"].holder.get_session_id()
    placeholder = {"op": "placeholder", "name": "logprobs", "target": "logprobs"}

    def create(args: list, seq: int) -> httpx.Response:
        nodes = [placeholder, {"op": "call_function", "name": "s", "target": "torch.add", "args": args},
                 {"op": "output", "name": "output", "target": "output",
                  "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}]}]
        return httpx.post(f"{server.base_url}/api/v1/create_custom_loss", headers={"X-API-Key": "tml-hostile-attacker"},
                          timeout=60, json={"session_id": session, "custom_loss_seq_id": seq, "name": "huge",
                                            "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"nodes": nodes}})

    refs = create([{"ref": "logprobs"}] * 100_000, 9000)
    assert refs.status_code == 400 and refs.json()["category"] == "user"
    assert "--custom-loss-max-constants" in refs.json()["error"]
    body = create([{"ref": "logprobs"}] * 1_000_000, 9001)
    assert body.status_code == 400 and "--custom-loss-max-nodes" in body.json()["error"]
    assert "bytes" in body.json()["error"]
    assert create([{"ref": "logprobs"}] * 2, 9002).status_code == 200


def test_an_index_of_python_values_is_refused_by_the_element_budget(tenants):
    """Row 7: ``square[[0] * 1024]`` on a [1, T, T] value asks for 1024 × T² elements: a user error naming
    --custom-loss-max-elements (``tests/test_shims_custom_loss.py`` shows it comes before the allocation), and an
    honest request of the same tenant still runs."""

    def listed(logprobs):
        square = (logprobs.unsqueeze(0) * logprobs.unsqueeze(1)).unsqueeze(0)
        return square[[0] * 1024].sum(), {}

    client = tenants["attacker"].create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=34)
    handle = tenants["attacker"].create_custom_loss(listed, {"logprobs": 1}).result()
    datum = make_datum(list(range(1, 200)), list(range(2, 102)))  # 300 positions: 1024 × 300² > 2**26
    with pytest.raises(tinker.RequestFailedError) as failure:
        client.forward_backward_custom([datum], handle).result()
    assert failure.value.category == tinker.types.RequestErrorCategory.User
    assert "--custom-loss-max-elements" in str(failure.value)
    assert client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
