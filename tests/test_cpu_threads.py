"""Each trainer and sampler actor computes with the CPUs its machine gives it (``adapters.cpu_threads``), not the one
thread Ray's ``OMP_NUM_THREADS`` would leave it: read from the real server started with its defaults, as each actor
reports ``torch.get_num_threads()`` from inside itself, in ``/api/v1/metrics`` and on the ready line."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import torch

from adapters.cpu_threads import SPLIT_WORK, PassThreads, cgroup_cpu_quota, default_threads, sampler_environment
from adapters.trainer.actor import LoraSpec, MultiLoRATrainer
from adapters.trainer.options import TrainerOptions
from shims.tinker.training_wire import DatumArrays
from tests.helpers import BASE_MODEL, machine_cpus


@pytest.fixture(scope="module")
def server(backend_server):
    return backend_server


def test_every_actor_of_the_default_server_runs_the_machine_cpus(server):
    answer = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin, timeout=30).json()
    trainer = answer["training"][BASE_MODEL]
    expected = machine_cpus()
    assert trainer["torch_threads"] == expected
    assert [shard["torch_threads"] for shard in trainer["shards"]] == [expected]
    replicas = answer["sampling"][BASE_MODEL]["replicas"]
    workers = [n for replica in replicas for n in replica["torch_threads"]]
    assert len(workers) == len(replicas) >= 1  # one process computes per replica (vLLM: its one worker)
    if "vllm" in server.args:  # vLLM's CPU worker: the cores vLLM bound it to, as vLLM logged them
        bound = re.findall(r"local_rank=0, core ids=\[([\d, ]+)\]", server.log())
        assert bound, "vLLM logged no CPU binding"
        assert workers == [len(bound[-1].split(","))] * len(replicas)
        assert all(1 <= n <= expected for n in workers)
    else:  # transformers: read on the thread its batches run on
        assert workers == [expected] * len(replicas)
    said = f"torch threads: trainer {expected}, samplers {'+'.join(map(str, workers))}"
    assert said in server.log(), "the ready line says how many threads each actor runs"


def test_the_default_is_an_even_share_for_processes_busy_together():
    assert default_threads(16) == 16
    assert default_threads(16, peers=4) == 4
    assert default_threads(3, peers=2) == 1
    assert default_threads(1, peers=4) == 1


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "250000 100000\n"}, 2.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),
    ({}, None),
], ids=["v2 unlimited", "v2 2.5 CPUs", "v1 unlimited", "v1 4 CPUs", "none"])
def test_a_container_cpu_quota_is_read(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == quota


def test_a_transformers_sampler_idle_threads_sleep_unless_the_operator_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert sampler_environment("transformers") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert sampler_environment("vllm") == {}  # vLLM's workers run as vLLM sets them
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert sampler_environment("transformers") == {}  # the actors inherit the operator's


def test_a_pass_too_small_to_split_runs_on_one_thread():
    threads = PassThreads(most=8, per_token=256 * 512, fixed=False)
    assert threads.count(SPLIT_WORK // (256 * 512) - 1) == 1
    assert threads.count(SPLIT_WORK // (256 * 512)) == 8
    assert PassThreads(most=8, per_token=256 * 512, fixed=True).count(1) == 8  # --trainer-threads is kept as given


def _step(trainer: MultiLoRATrainer, length: int) -> int:
    tokens = np.arange(length + 1) % 400
    trainer.forward_backward("run", [DatumArrays(tokens=tokens[:-1], loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": np.ones(length, np.float32)})], "cross_entropy", {}, False)
    return torch.get_num_threads()


@pytest.mark.skipif(machine_cpus() < 2, reason="one CPU: every pass runs on one thread whatever its size")
@pytest.mark.parametrize("configured", [None, 2])
def test_the_trainer_runs_small_passes_on_one_thread_and_large_ones_on_all(tiny_model_dir, configured):
    before = torch.get_num_threads()
    try:
        trainer = MultiLoRATrainer(str(tiny_model_dir), TrainerOptions(threads=configured))
        trainer.create("run", LoraSpec(rank=4, seed=0))
        most = trainer.threads.most  # what torch read back when the trainer set its count
        assert most == (configured or machine_cpus())
        small = SPLIT_WORK // trainer.threads.per_token - 1
        assert _step(trainer, small) == (most if configured else 1)
        assert _step(trainer, small + 1) == most
        assert _step(trainer, 8) == (most if configured else 1)
        assert trainer.model_facts().threads == most  # what the metrics and the ready line report
    finally:
        torch.set_num_threads(before)  # this test process's other tests keep theirs
