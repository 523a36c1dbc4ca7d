"""Scale-out: a 2-node Ray cluster on this machine (a head and a worker joining it, each with its own custom
resource), the server joining it with --ray-address, the trainer placed on one node and the samplers on the other,
and the train → save → sample flow across them through a shared storage directory; a trainer whose two shards sit on
the two nodes; refusals of what the cluster lacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL, make_datum, train
from tests.server import free_port, start_server

RAY = str(Path(sys.executable).with_name("ray"))
NODES = """
import json, ray
ray.init(address="{address}", log_to_driver=False)
print(json.dumps({{n["NodeID"]: sorted(k for k in n["Resources"] if k.endswith("_node")) for n in ray.nodes()}}))
"""


@pytest.fixture(scope="module")
def cluster():
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    log = open(Path(ray_tmp, "nodes.log"), "wb")  # noqa: SIM115 - the node processes write to it while they live
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    address = f"127.0.0.1:{free_port()}"

    def common() -> list[str]:  # its own ports, clear of the other Ray instance the test session runs
        return ["--block", "--node-ip-address=127.0.0.1", "--object-store-memory", str(100 * 1024 * 1024),
                "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}"]

    nodes = [subprocess.Popen([RAY, "start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=1",
                               "--resources", json.dumps({"trainer_node": 1, "shard_slot": 1}),
                               "--include-dashboard=false", *common()],
                              env=env, stdout=log, stderr=subprocess.STDOUT)]
    try:
        _wait_for(lambda: _status(address, env).returncode == 0, "the Ray head", Path(ray_tmp, "nodes.log"))
        nodes.append(subprocess.Popen([RAY, "start", f"--address={address}", "--num-cpus=2", "--resources",
                                       json.dumps({"sampler_node": 1, "shard_slot": 1}), *common()],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
        _wait_for(lambda: "sampler_node" in _status(address, env).stdout, "the second Ray node",
                  Path(ray_tmp, "nodes.log"))
        yield address, env
    finally:
        for node in reversed(nodes):
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _status(address: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, "status", f"--address={address}"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def _wait_for(ready, what: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up in {timeout:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(1)


@pytest.mark.timeout(600)
def test_trainer_and_samplers_on_different_nodes(cluster, model_cache, tmp_path):
    address, env = cluster
    shared = tmp_path / "shared-storage"
    server = start_server(tmp_path / "data", "--ray-address", address, "--trainer-resource", "trainer_node=1",
                          "--sampler-resource", "sampler_node=1", "--trainer-cpus", "1", "--sampler-cpus", "1",
                          "--storage-dir", str(shared), env=env)
    try:
        nodes = json.loads(subprocess.run([sys.executable, "-c", NODES.format(address=address)], env=env,
                                          capture_output=True, text=True, timeout=120, check=True).stdout)
        metrics = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()
        assert nodes[metrics["training"][BASE_MODEL]["node"]] == ["trainer_node"]
        assert [nodes[r["node"]] for r in metrics["sampling"][BASE_MODEL]["replicas"]] == [["sampler_node"]]

        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-cluster")
        client = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
        prompt, target = [11, 42, 77, 103], [250, 3, 99]
        train(client, make_datum(prompt, target), 20, types.AdamParams(learning_rate=3e-3))
        path = client.save_weights_for_sampler("across-nodes").result().path
        assert any(shared.rglob("adapter_model.safetensors"))  # written where every node can read it
        sampler = service.create_sampling_client(model_path=path).result()
        out = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                             types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])).result()
        assert out.sequences[0].tokens == target  # the sampler node serves what the trainer node learned
        service.close("success")
    finally:
        server.stop()


def test_a_cluster_without_the_asked_resources_is_refused_at_start(cluster, model_cache, tmp_path):
    address, env = cluster
    with pytest.raises(RuntimeError, match="lacks the custom resources"):
        start_server(tmp_path / "data", "--ray-address", address, "--trainer-resource", "gpu_box=1", env=env,
                     timeout=120)


@pytest.mark.parametrize(("options", "missing"), [
    (("--sampler-backend", "vllm", "--sampler-tensor-parallel-size", "2", "--sampler-gpus", "2"),
     ("the Ray cluster has 0 GPUs, but 1 sampler replica × 2 GPUs (--sampler-tensor-parallel-size 2) ask for 2: 2 "
      "GPUs missing")),
    (("--trainer-shards", "2", "--trainer-gpus", "1"),
     "the Ray cluster has 0 GPUs, but 2 trainer shards × 1 GPU (--trainer-shards 2) ask for 2: 2 GPUs missing"),
], ids=["tensor-parallel-samplers", "trainer-shards"])
def test_a_cluster_without_the_gpus_asked_for_is_refused_at_start(cluster, model_cache, tmp_path, options, missing):
    """Tensor-parallel vLLM samplers, or a trainer sharded over GPUs, on a cluster with none: the server says in one
    line what is missing, before any actor would wait for GPUs forever."""
    address, env = cluster
    with pytest.raises(RuntimeError, match="server exited") as failed:
        start_server(tmp_path / "data", "--ray-address", address, *options, env=env, timeout=120, attempts=1)
    line = next(line for line in str(failed.value).splitlines() if "cannot start" in line)
    assert missing in line and "Traceback" not in str(failed.value)


@pytest.mark.timeout(600)
def test_a_trainer_split_over_two_nodes_trains_and_its_sampler_serves_it(cluster, model_cache, tmp_path):
    """--trainer-shards 2 where each node has room for one shard (``shard_slot``): one shard on each node, talking
    through gloo across them, trains an adapter that the sampler then serves."""
    address, env = cluster
    server = start_server(tmp_path / "data", "--ray-address", address, "--trainer-shards", "2", "--trainer-cpus", "0.5",
                          "--trainer-resource", "shard_slot=1", "--sampler-resource", "sampler_node=1",
                          "--sampler-cpus", "1",
                          "--storage-dir", str(tmp_path / "shared-storage"), env=env)
    try:
        nodes = json.loads(subprocess.run([sys.executable, "-c", NODES.format(address=address)], env=env,
                                          capture_output=True, text=True, timeout=120, check=True).stdout)
        shards = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()["training"][BASE_MODEL][
            "shards"]
        assert sorted(nodes[s["node"]] for s in shards) == [["sampler_node"], ["trainer_node"]]
        assert {s["backend"] for s in shards} == {"gloo"}

        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-cluster")
        client = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
        prompt, target = [11, 42, 77, 103], [250, 3, 99]
        losses = train(client, make_datum(prompt, target), 20, types.AdamParams(learning_rate=3e-3))
        assert losses[-1] < 0.1 * losses[0], losses
        sampler = client.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                             types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])).result()
        assert out.sequences[0].tokens == target
        service.close("success")
    finally:
        server.stop()
