"""An RL loop through the real server, several tenants at once, on both sampler backends: sample with the current
weights, train on the samples, hand the new weights off (in memory), sample again. Every sampled logprob must be the
trainer's forward of the weights that sample was meant to use — a snapshot's weights at its save, an inflight
client's latest — so a hand-off that reached a sampler late, twice, or with another tenant's weights shows up."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tinker
from tinker import types

from tests.families import family_dir, matrix_datum
from tests.helpers import BASE_MODEL, forward_logprobs, on_both_sampler_backends, train
from tests.server import start_server

server, service_client = on_both_sampler_backends()  # every test here runs once per sampler backend

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
PROMPTS = [[11, 42, 77, 103, 250], [19, 7, 301, 17], [96, 45, 12, 8, 200, 31]]
STEPS = 3


def datum_for(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """The sampled sequence as a policy-gradient datum (the cookbook's shape: ``importance_sampling`` with the
    sampler's logprobs at the completion's positions)."""
    tokens = prompt + completion
    start = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "logprobs": np.array([0.0] * start + list(logprobs), dtype=np.float32),
        "advantages": np.array([0.0] * start + [advantage] * len(completion), dtype=np.float32)})


def trainer_logprobs(client, prompt: list[int], completion: list[int]) -> np.ndarray:
    """The trainer's forward of its current weights: logprobs of ``completion`` after ``prompt``."""
    tokens = prompt + completion
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": np.ones(len(tokens) - 1, np.float32)})
    out = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    return out[len(prompt) - 1:]


def tenant_loop(base_url: str, tenant: int, kind: str) -> list[str]:
    """One tenant's loop; returns what disagreed (empty when every sample used the weights it was meant to)."""
    service = tinker.ServiceClient(base_url=base_url, api_key=f"tml-test-rl-{tenant}{WORKER}")
    problems: list[str] = []
    try:
        client = service.create_lora_training_client(base_model=BASE_MODEL, rank=2 + 2 * tenant, seed=tenant).result()
        prompt = PROMPTS[tenant]
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=100 + tenant, stop=[])
        first: tuple[tinker.SamplingClient, list[int], np.ndarray] | None = None
        for step in range(STEPS):
            sampler = client.save_weights_and_get_sampling_client(kind=kind).result()
            result = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
            data = []
            for i, seq in enumerate(result.sequences):
                expected = trainer_logprobs(client, prompt, seq.tokens)  # before any optim step: the handed weights
                gap = float(np.abs(np.asarray(seq.logprobs) - expected).max())
                if gap > 1e-4:
                    problems.append(f"tenant {tenant} step {step} sample {i}: logprobs differ from the trainer's by "
                                    f"{gap:.2e}")
                if first is None:
                    first = (sampler, list(seq.tokens), expected)
                data.append(datum_for(prompt, list(seq.tokens), seq.logprobs, advantage=1.0 if i == 0 else -1.0))
            client.forward_backward(data, "importance_sampling").result()
            client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        # A snapshot keeps its weights while its client lives; an inflight client follows the latest save.
        old_sampler, tokens, expected = first
        if kind == "inflight":
            client.save_weights_and_get_sampling_client(kind=kind).result()
            latest = trainer_logprobs(client, prompt, tokens)
            if float(np.abs(latest - expected).max()) < 1e-3:
                problems.append(f"tenant {tenant}: training did not move the weights; the check below would be void")
            expected = latest
        again = old_sampler.compute_logprobs(types.ModelInput.from_ints(prompt + tokens)).result()[len(prompt):]
        gap = float(np.abs(np.asarray(again) - expected).max())
        if gap > 1e-4:
            problems.append(f"tenant {tenant}: its first {kind} client samples other weights than it should "
                            f"({gap:.2e})")
    finally:
        service.close("success")
    return problems


def test_an_rl_loop_of_several_tenants_samples_exactly_the_weights_handed_off(server):
    kinds = ["snapshot", "snapshot", "inflight"]
    with ThreadPoolExecutor(len(kinds)) as pool:
        outcomes = list(pool.map(lambda args: tenant_loop(server.base_url, *args), enumerate(kinds)))
    assert [problem for problems in outcomes for problem in problems] == []
    assert [p for p in (server.data_dir / "ephemeral").rglob("*") if p.is_file()] == []  # all in memory


def test_a_sharded_trainer_hands_each_shards_experts_to_the_sampler(model_cache, tmp_path):
    """--trainer-shards 2 on a mixture of experts: each shard hands its own experts over (no gather through rank 0),
    and the sampler, joining the parts, samples exactly the trainer's weights; nothing is written."""
    directory = str(family_dir("qwen3_moe"))
    server = start_server(tmp_path / "data", "--base-model", directory, "--trainer-shards", "2",
                          "--trainer-cpus", "0.5", "--sampler-cpus", "0.5", timeout=600)
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=f"tml-test-rl-shards{WORKER}")
        client = service.create_lora_training_client(base_model=directory, rank=4, seed=0).result()
        datum, tokens = matrix_datum()
        train(client, datum, 2)
        sampler = client.save_weights_and_get_sampling_client().result()
        sampled = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
        np.testing.assert_allclose(sampled, forward_logprobs(client, datum), atol=1e-4)
        assert f"sampler weights saved (snapshot, in memory): {client.model_id}" in server.log()
        assert [p for p in (server.data_dir / "ephemeral").rglob("*") if p.is_file()] == []
        service.close("success")
    finally:
        server.stop()
