"""A server with two sampler replicas: every adapter's requests stay on the replica that holds it."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL, make_datum, train

PROMPT, TARGET = [5, 9, 33, 71, 2], [80, 81, 82]


@pytest.fixture(scope="module")
def two_sampler_server(model_cache, tmp_path_factory):
    from tests.server import start_server

    running = start_server(tmp_path_factory.mktemp("two-samplers"), "--samplers", "2", "--sampler-threads", "1",
                           "--trainer-threads", "1")
    yield running
    running.stop()


def test_adapters_stick_to_one_replica_and_results_are_right(two_sampler_server):
    service = tinker.ServiceClient(base_url=two_sampler_server.base_url, api_key="tml-pool")
    try:
        paths = []
        for seed in (1, 2):
            client = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=seed).result()
            train(client, make_datum(PROMPT, TARGET), 2, types.AdamParams(learning_rate=1e-2))
            paths.append(client.save_weights_for_sampler(f"adapter-{seed}").result().path)
        samplers = [service.create_sampling_client(model_path=p).result() for p in paths]
        params = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
        prompt = types.ModelInput.from_ints(PROMPT)
        expected = [s.sample(prompt, 1, params).result().sequences[0].tokens for s in samplers]
        futures = [(i % 2, samplers[i % 2].sample(prompt, 1, params)) for i in range(12)]
        for which, future in futures:
            assert future.result().sequences[0].tokens == expected[which]
        answer = httpx.get(f"{two_sampler_server.base_url}/api/v1/metrics", headers=two_sampler_server.admin).json()
        metrics = answer["sampling"][BASE_MODEL]
        replicas = metrics["replicas"]
        assert len(replicas) == 2
        # The operator's thread counts, as each actor reads them inside itself (the default is the machine's CPUs).
        assert [r["torch_threads"] for r in replicas] == [[1], [1]]
        assert answer["training"][BASE_MODEL]["torch_threads"] == 1
        assert sum(r["resident_adapters"] for r in replicas) == 2  # each adapter loaded on exactly one replica
        assert metrics["requests"] == 14 and metrics["failed"] == 0
    finally:
        service.close("success")
