"""``--sampler-tensor-parallel-size``: a vLLM sampler replica split over 2 workers (vLLM's CPU build here, each worker
bound to its own cores) returns the logprobs of the size-1 vLLM server, for the base model and for a trained LoRA
adapter, alone and in a mixed batch; and the pure pieces: the CPU thread binding, the GPUs a replica reserves, and the
refusals of what cannot run (``adapters/samplers/vllm/parallel.py``, ``compat_server/devices.py``).

The size-1 reference is the session's ``vllm_server``; this module starts one more server, the size-2 one. Measured
on 2 cores in fp32: the largest gap over prompt and sampled-token logprobs is below 1e-6 (the all-reduce of the two
workers' partial sums rounds differently); 1e-5 is asserted.
"""

from __future__ import annotations

import os
from concurrent.futures import Future

import httpx
import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from adapters.samplers.options import SamplerOptions
from adapters.samplers.pool import SamplerPool
from adapters.samplers.vllm.parallel import (
    THREADS_BIND,
    CannotBind,
    backend_refusal,
    cpu_threads_bind,
    gpus_per_replica_problem,
    kv_cache_bytes_per_worker,
    omp_threads_bind,
)
from compat_server.config import ServerConfig
from shims.errors import ConfigurationRefused
from tests.helpers import BASE_MODEL, checkpoint_dir, make_datum, skip_without_vllm, train
from tests.server import start_server

TOLERANCE = 1e-5
PROMPT = [11, 42, 77, 103, 250, 19, 7, 301, 17]
GREEDY = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
KEY = "tml-tensor-parallel"


# The pure pieces.

def test_cpus_are_split_into_contiguous_groups_one_per_worker():
    assert omp_threads_bind([1, 0], 2) == "0|1"
    assert omp_threads_bind(range(8), 2) == "0-3|4-7"
    assert omp_threads_bind(range(7), 3) == "0-2|3-4|5-6"  # the first groups take one more
    assert omp_threads_bind([0, 2, 3, 5, 6, 7], 2) == "0,2-3|5-7"  # only the CPUs given, as ranges vLLM parses
    with pytest.raises(ValueError):
        omp_threads_bind([0], 2)


def test_the_binding_is_derived_only_where_vllms_own_would_refuse():
    assert cpu_threads_bind(2, {0, 1}, numa_nodes=1, environ={}) == "0|1"
    assert cpu_threads_bind(2, {0, 1}, numa_nodes=1, environ={THREADS_BIND: "auto"}) == "0|1"
    assert cpu_threads_bind(1, {0, 1}, numa_nodes=1, environ={}) is None  # one worker: vLLM binds it itself
    assert cpu_threads_bind(2, range(64), numa_nodes=2, environ={}) is None  # a NUMA node per worker: vLLM's binding
    assert cpu_threads_bind(2, {0, 1}, numa_nodes=1, environ={THREADS_BIND: "0|0"}) is None  # the operator's
    with pytest.raises(CannotBind) as refused:
        cpu_threads_bind(4, {0, 1}, numa_nodes=1, environ={})
    assert "--sampler-tensor-parallel-size 4" in str(refused.value) and THREADS_BIND in str(refused.value)


def test_the_kv_cache_of_an_engine_is_shared_among_its_workers():
    assert kv_cache_bytes_per_worker(1.0, 1) == 2**30
    assert kv_cache_bytes_per_worker(1.0, 2) == 2**29


def test_a_tensor_parallel_replica_holds_whole_gpus_or_none():
    assert gpus_per_replica_problem(1, 0.25) is None
    for fine in (None, 0, 2, 2.0):
        assert gpus_per_replica_problem(2, fine) is None
    for wrong in (0.5, 1, 4):
        problem = gpus_per_replica_problem(2, wrong)
        assert "--sampler-gpus" in problem and "--sampler-tensor-parallel-size 2" in problem
    config = ServerConfig(sampler=SamplerOptions(tensor_parallel_size=2, gpus=0.5))
    with pytest.raises(ValueError, match="--sampler-gpus 0.5 does not fit --sampler-tensor-parallel-size 2"):
        config.validate()


def test_only_the_vllm_backend_takes_a_tensor_parallel_size():
    assert backend_refusal("vllm", 2) is None and backend_refusal("transformers", 1) is None
    with pytest.raises(ConfigurationRefused, match="--sampler-tensor-parallel-size 2 .* --sampler-backend vllm"):
        SamplerPool([], SamplerOptions(backend="transformers", tensor_parallel_size=2))


# Through the server: size 2 against the session's size-1 vLLM server.

@pytest.fixture(scope="module")
def tp_server(model_cache, tmp_path_factory):
    skip_without_vllm()
    running = start_server(tmp_path_factory.mktemp("vllm-tp2"), "--sampler-backend", "vllm",
                           "--sampler-tensor-parallel-size", "2", timeout=400)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def servers(vllm_server, tp_server):
    """The size-1 and the size-2 server, each with a service client and an adapter trained the same way (same seed,
    data and steps, so the same weights) and its sampling client."""
    made = {}
    for size, server in ((1, vllm_server), (2, tp_server)):
        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        run = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=33).result()
        train(run, make_datum(PROMPT[:5], PROMPT[5:]), 2, types.AdamParams(learning_rate=1e-2))
        path = run.save_weights_for_sampler("tensor-parallel").result().path
        made[size] = {"server": server, "service": service, "path": path,
                      "base": service.create_sampling_client(base_model=BASE_MODEL).result(),
                      "lora": run.create_sampling_client(model_path=path).result()}
    yield made
    for each in made.values():
        each["service"].close("success")


def scored(future: Future) -> tuple[list[int], np.ndarray, np.ndarray]:
    """A greedy sample's tokens, their logprobs and the prompt's logprobs."""
    result = future.result()
    return result.sequences[0].tokens, np.array(result.sequences[0].logprobs), np.array(result.prompt_logprobs[1:])


def ask(sampler, prompt=PROMPT) -> Future:
    return sampler.sample(types.ModelInput.from_ints(prompt), 1, GREEDY, include_prompt_logprobs=True)


@pytest.mark.parametrize("weights", ["base", "lora"])
def test_size_2_returns_the_logprobs_of_size_1(servers, weights):
    if weights == "lora":  # the samplers are given the same adapter: what differs below is the samplers alone
        saved = [load_file(checkpoint_dir(servers[size]["server"].data_dir, servers[size]["path"])
                           / "adapter_model.safetensors") for size in (1, 2)]
        assert saved[0].keys() == saved[1].keys()
        assert all(np.array_equal(saved[0][key], saved[1][key]) for key in saved[0])
    one, two = (scored(ask(servers[size][weights])) for size in (1, 2))
    assert two[0] == one[0]
    np.testing.assert_allclose(two[1], one[1], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(two[2], one[2], rtol=0, atol=TOLERANCE)
    if weights == "lora":
        base = scored(ask(servers[2]["base"]))
        assert np.abs(base[2] - two[2]).max() > 1e-2  # the adapter counts in what was compared


def test_a_mixed_batch_on_size_2_equals_requests_alone(servers):
    """Concurrent prompt-logprob requests with and without the adapter (one engine step on both workers, through
    ``adapters.samplers.vllm.patches``' corrections, installed in each worker) give what each gives alone."""
    samplers = [servers[2]["lora"], servers[2]["base"], servers[2]["lora"], servers[2]["base"]]
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:], PROMPT + [44, 5]]
    together = [ask(sampler, prompt) for sampler, prompt in zip(samplers, prompts)]
    together = [scored(future) for future in together]
    for (sampler, prompt), batched in zip(zip(samplers, prompts), together):
        alone = scored(ask(sampler, prompt))
        assert batched[0] == alone[0]
        np.testing.assert_allclose(batched[1], alone[1], rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(batched[2], alone[2], rtol=0, atol=TOLERANCE)


def test_the_ready_line_and_metrics_say_each_replicas_size(tp_server, vllm_server):
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    sampling = httpx.get(f"{tp_server.base_url}/api/v1/metrics", headers=tp_server.admin).json()["sampling"][BASE_MODEL]
    assert sampling["tensor_parallel_size"] == 2
    assert [replica["tensor_parallel_size"] for replica in sampling["replicas"]] == [2]
    reference = httpx.get(f"{vllm_server.base_url}/api/v1/metrics", headers=vllm_server.admin).json()
    assert reference["sampling"][BASE_MODEL]["tensor_parallel_size"] == 1
    log = tp_server.log()
    assert f"samplers ready: {BASE_MODEL} × 1 (vllm on cpu, tensor parallel 2," in log
    # The server inherits this process's CPUs and environment: where vLLM's own binding would refuse 2 workers
    # (fewer than 2 NUMA nodes; CI's 2 cores), each worker was bound to its own cores.
    binding = cpu_threads_bind(2, os.sched_getaffinity(0), len(get_visible_memory_node()), os.environ)
    if binding is not None:
        assert f"vLLM's 2 CPU workers bound to cores {binding.replace('|', ' | ')}" in log
