"""Issue 44's High findings against the real server and SDK: a request's trainer cost is its real work, bounded
before it runs, so a tenant whose batch has an odd shape — one long datum among many one-token ones, thousands of
one-token datums, a custom loss that is slow over many datums — gets its answer (or a 4xx naming the limit) in time
proportional to its real tokens, and another tenant's step sent beside it is not held up.

Before the trainer packed datums (``adapters.trainer.packing``) a batch was padded to rows × its longest datum, and
each datum's rows were sliced out of the batch, each slice's gradient as large as the whole batch: the first shape
below ran 602,000 padded positions for 2,300 real tokens, the second took time quadratic in its datums. The time
bounds are wide (many times what the work takes here) and far below what those shapes took before."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.helpers import BASE_MODEL, make_datum, one_request, poll_future

ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture(scope="module")
def tenants(server):
    clients = {role: tinker.ServiceClient(base_url=server.base_url, api_key=f"tml-cost-{role}")
               for role in ("victim", "odd")}
    yield clients
    for client in clients.values():
        client.close("success")


def one_token_datums(count: int, seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    return [make_datum(*(rng.integers(1, 500, 1).tolist() for _ in range(2))) for _ in range(count)]


def victim_step(client) -> float:
    """Seconds one small training step (16 tokens) takes to come back."""
    started = time.monotonic()
    client.forward_backward([make_datum(list(range(3, 11)), list(range(20, 29)))], "cross_entropy").result()
    client.optim_step(ADAM).result()
    return time.monotonic() - started


def test_one_long_datum_among_one_token_datums_costs_its_real_tokens(tenants):
    """1 × 2,000 + 300 × 1 tokens (2,300 real; 602,000 positions padded to a rectangle). It runs, its logprobs are
    those of each datum alone, and a victim's step sent right after it comes back in seconds."""
    odd = tenants["odd"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    victim = tenants["victim"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    rng = np.random.default_rng(0)
    long = make_datum(rng.integers(1, 500, 1000).tolist(), rng.integers(1, 500, 1001).tolist())
    data = [long, *one_token_datums(300, 1)]
    started = time.monotonic()
    batch = odd.forward_backward(data, "cross_entropy")
    waited = victim_step(victim)
    result = batch.result()
    took = time.monotonic() - started
    assert waited < 30 and took < 30, (waited, took)
    alone = odd.forward([long, data[1]], "cross_entropy").result()
    for mine, theirs in zip(result.loss_fn_outputs[:2], alone.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(mine["logprobs"].to_numpy(), theirs["logprobs"].to_numpy(), atol=1e-5)


def test_thousands_of_one_token_datums_cost_linear_time(tenants, server):
    """20,000 one-token datums in one request (sent as one, as a client may: the SDK would split them into requests
    of 1,024) train in time linear in the datums (the batch-sized gradient of each datum's slice made it quadratic),
    while a victim's step sent beside it comes back in seconds."""
    odd = tenants["odd"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    victim = tenants["victim"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    started = time.monotonic()
    request_id = one_request(server.base_url, "tml-cost-odd", odd.model_id, 1, one_token_datums(20_000, 2))
    waited = victim_step(victim)
    answer = poll_future(server.base_url, request_id, "tml-cost-odd")
    took = time.monotonic() - started
    assert isinstance(answer, bytes), answer  # the protobuf result, not an error
    assert waited < 40 and took < 40, (waited, took)


def slow_over_many_datums(logprobs):
    """About a second per datum (a sort of 4M values made by doubling), within every per-step bound."""
    x = logprobs.unsqueeze(0)
    for _ in range(22):
        x = torch.cat([x, x])
    noise = (x.flatten().cumsum(0) * 12.9898).sin()
    return noise.sort().values.sum() * 0.0 + logprobs.sum(), {}


def test_a_custom_loss_slow_over_many_datums_is_bounded_for_the_whole_request(tenants):
    """A custom loss that stays within every per-datum bound but is slow over 30 datums fails its own request with a
    user error naming --custom-loss-max-seconds (10 s by default) once the request's time is spent, rather than
    holding the trainer for all 30; the victim's step sent beside it waits no longer than that budget."""
    odd = tenants["odd"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    victim = tenants["victim"].create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result()
    loss_id = tenants["odd"].create_custom_loss(slow_over_many_datums, {"logprobs": 1}).result().loss_id
    started = time.monotonic()
    batch = odd.forward_backward(one_token_datums(30, 3), "custom", {"loss_id": loss_id})
    waited = victim_step(victim)
    with pytest.raises(tinker.RequestFailedError) as failure:
        batch.result()
    took = time.monotonic() - started
    assert failure.value.category == tinker.types.RequestErrorCategory.User
    assert "--custom-loss-max-seconds" in str(failure.value) and "all its datums" in str(failure.value)
    assert took < 25 and waited < 25, (waited, took)
