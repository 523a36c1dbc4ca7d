"""What the trainers and samplers ask of the cluster's GPUs (``compat_server.devices``): each one's default share,
and the refusal at start, naming what is missing, of a cluster that lacks them."""

from __future__ import annotations

import pytest

from compat_server.cli.main import build_parser, config_from_args
from compat_server.devices import GpuAsk, gpu_refusal, gpu_shares
from shims.errors import ConfigurationRefused


def ask(flags: str = "", models: int = 1) -> GpuAsk:
    """What ``compat-server serve <flags>`` asks of the GPUs for ``models`` base models."""
    config = config_from_args(build_parser().parse_args(["serve", *flags.split()]))
    return GpuAsk(models, config.trainer, config.sampler)


def test_default_shares_count_every_worker_of_every_replica_and_every_shard():
    assert gpu_shares(0, ask("--sampler-tensor-parallel-size 2")) == (0.0, 0.0)  # on CPU
    assert gpu_shares(5, ask("--samplers 2 --sampler-tensor-parallel-size 2")) == (1.0, 2.0)  # 1 + 2 × 2
    assert gpu_shares(4, ask("--samplers 2 --sampler-tensor-parallel-size 2")) == (1.0, 2.0)  # too few: refused (below)
    assert gpu_shares(1, ask()) == (0.5, 0.5) and gpu_shares(3, ask("--samplers 2")) == (1.0, 1.0)
    assert gpu_shares(0, ask("--trainer-shards 2")) == (0.0, 0.0)  # shards on CPUs (gloo)
    assert gpu_shares(8, ask("--trainer-shards 4 --samplers 2 --sampler-tensor-parallel-size 2")) == (1.0, 2.0)
    assert gpu_shares(5, ask("--trainer-shards 4 --samplers 2")) == (1.0, 0.5)  # the samplers share what is left
    assert gpu_shares(2, ask("--trainer-shards 4")) == (1.0, 1.0)  # too few: refused (below)
    assert gpu_shares(1, ask("--trainer-shards 1", models=2)) == (0.25, 0.25)


def test_a_shard_never_gets_part_of_a_gpu():
    with pytest.raises(ConfigurationRefused, match="--trainer-shards 2 puts each trainer shard on GPUs of its own"):
        gpu_shares(1, ask("--trainer-shards 2 --trainer-gpus 0.5"))
    assert gpu_shares(4, ask("--trainer-shards 2 --trainer-gpus 2 --sampler-gpus 0")) == (2, 0)


def test_a_cluster_without_the_gpus_asked_for_is_refused_naming_what_is_missing():
    assert gpu_refusal([5], ask("--samplers 2 --sampler-tensor-parallel-size 2"), 1.0, 2.0) is None
    assert gpu_refusal([2, 2, 1], ask("--samplers 2 --sampler-tensor-parallel-size 2"), 1.0, 2.0) is None  # a node each
    assert gpu_refusal([1], ask("--samplers 3"), 0.5, 0.5 / 3) is None  # one GPU shared (rounding error and all)
    assert gpu_refusal([], ask(), 0.0, 0.0) is None  # all on CPU
    missing = gpu_refusal([4], ask("--samplers 2 --sampler-tensor-parallel-size 2"), 1.0, 2.0)
    assert "has 4 GPUs" in missing and "2 sampler replicas × 2 GPUs (--sampler-tensor-parallel-size 2)" in missing
    assert "1 trainer × 1 GPU" in missing and "1 GPU missing" in missing
    assert "0 GPUs" in gpu_refusal([], ask("--sampler-tensor-parallel-size 2"), 0.0, 2.0)
    apart = gpu_refusal([1, 1, 1, 1], ask("--sampler-tensor-parallel-size 2"), 0.0, 2.0)  # never two on one node
    assert "needs 2 GPUs on one node" in apart and "room for 0 of the 1 replica" in apart
    wide = ask("--trainer-shards 4 --samplers 2 --sampler-tensor-parallel-size 2")
    assert gpu_refusal([4, 4], wide, 1.0, 2.0) is None
    shards = gpu_refusal([2], ask("--trainer-shards 4"), 1.0, 1.0)
    assert "4 trainer shards × 1 GPU (--trainer-shards 4)" in shards and "3 GPUs missing" in shards
