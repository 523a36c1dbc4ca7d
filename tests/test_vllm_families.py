"""The vLLM column of the family matrix (issue 32), through the real server and the SDK, on vLLM's CPU build.

One server with ``--sampler-backend vllm`` serves the tiny families vLLM's CPU build can serve with LoRA enabled
(``tests/families.py``'s ``VLLM_FAMILIES``): a run trains a few steps, and vLLM scores its saved sampler weights as
the trainer's forward does. What vLLM cannot serve is refused before anything is trained: an adapter on a weight group
its model class takes no LoRA on at ``create_lora_training_client``, naming the option to change, and a base model
it cannot serve at all when the server starts, naming ``--sampler-backend transformers``. What is refused for which
family, and why, is in ``adapters/samplers/vllm/support.py``; its decisions on each family's config are tested in
``tests/test_vllm_family_support.py``.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from safetensors.torch import load_file
from tinker import types

from tests.families import VLLM_FAMILIES, family_dir, matrix_datum, serve_families
from tests.helpers import checkpoint_dir, forward_logprobs, skip_without_vllm, train
from tests.server import start_server
from tests.test_cookbook_weights import KEY

pytestmark = pytest.mark.timeout(900)

DATUM, TOKENS = matrix_datum()
FAST = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def families(model_cache) -> dict[str, str]:
    return {name: str(family_dir(name)) for name in VLLM_FAMILIES}


@pytest.fixture(scope="module")
def server(families, tmp_path_factory):
    skip_without_vllm()
    running = serve_families(tmp_path_factory.mktemp("vllm-families"), list(families.values()), "vllm")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield service
    service.close("success")


def _vllm_scores_as_the_trainer(client, run, server, name: str) -> dict:
    """Train ``run`` 3 steps, save its sampler weights, and check vLLM's prompt logprobs of them equal the
    trainer's forward logprobs; returns the stored adapter's tensors."""
    train(run, DATUM, 3, FAST)
    ours = forward_logprobs(run, DATUM)
    path = run.save_weights_for_sampler(f"{name}-vllm").result().path
    sampler = run.create_sampling_client(model_path=path).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    base = client.create_sampling_client(base_model=run.get_info().model_data.model_name).result()
    untrained = base.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert np.abs(np.asarray(untrained[1:]) - ours).max() > 1e-2, "training moved nothing"
    np.testing.assert_allclose(np.asarray(scored[1:], dtype=np.float64), ours, atol=1e-4)
    return load_file(checkpoint_dir(server.data_dir, path) / "adapter_model.safetensors")


def test_capabilities_name_vllm_as_the_sampler_of_every_family(server, families):
    reply = httpx.get(f"{server.base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}).json()
    by_name = {model["model_name"]: model for model in reply["supported_models"]}
    assert {by_name[directory]["sampler_backend"] for directory in families.values()} == {"vllm"}


def test_a_mamba_hybrid_trains_every_group_and_vllm_serves_it(client, server, families):
    """Nemotron-H without MoE layers: attention, Mamba (``in_proj`` trained as ``gate_proj`` + ``x_proj``, stored
    fused, which is the only form vLLM loads), MLP and head, served by vLLM with the trainer's logprobs."""
    run = client.create_lora_training_client(base_model=families["nemotron_h_dense"], rank=4, seed=11).result()
    state = _vllm_scores_as_the_trainer(client, run, server, "nemotron")
    assert any(key.endswith(".mixer.in_proj.lora_A.weight") for key in state)
    assert any(key.endswith(".mixer.out_proj.lora_A.weight") for key in state)
    assert any(key.endswith("lm_head.lora_A.weight") for key in state)


def test_a_head_vllm_takes_no_lora_on_is_refused_at_create_naming_the_option(client, server, families):
    """vLLM's Qwen2 class takes no LoRA on ``lm_head``: the SDK's default ``train_unembed=True`` is refused at once
    with the option to change, the server goes on, and without the head the run trains and vLLM serves it."""
    with pytest.raises(tinker.RequestFailedError) as refused:
        client.create_lora_training_client(base_model=families["qwen2"], rank=4, seed=11).result()
    message = str(refused.value)
    assert refused.value.category == types.RequestErrorCategory.User
    assert "lm_head" in message and "train_unembed=False" in message and "--sampler-backend transformers" in message
    run = client.create_lora_training_client(base_model=families["qwen2"], rank=4, seed=11,
                                             train_unembed=False).result()
    state = _vllm_scores_as_the_trainer(client, run, server, "qwen2")
    assert not any("lm_head" in key for key in state) and any(".mlp.down_proj." in key for key in state)


def test_a_model_vllm_cannot_serve_is_refused_when_the_server_starts(model_cache, tmp_path):
    """A mixture-of-experts model on vLLM's CPU build (whose LoRA-enabled engine dies at the first sample, adapter
    or not): the server does not start, and says why and what to use instead in one line, before binding its
    port."""
    skip_without_vllm()
    directory = family_dir("qwen3_moe")
    with pytest.raises(RuntimeError, match="server exited") as failed:
        start_server(tmp_path / "refused", "--base-model", str(directory), "--trainer-cpus", "0.1", "--sampler-cpus",
                     "0.1", "--sampler-backend", "vllm", timeout=300, attempts=1)
    log = str(failed.value)
    line = next(line for line in log.splitlines() if "cannot start" in line)
    assert "mixture-of-experts" in line and "Start the server with --sampler-backend transformers" in line
    assert "Traceback" not in log
