"""The GPUs a configuration asks the Ray cluster for: each trainer shard's and sampler replica's share, and the check,
when the server starts, that the cluster has them.

An actor asking for GPUs that no node has is never placed: Ray waits for them forever, and the server would sit
unready with no word of why. So before any actor is created the server compares what its trainers and sampler
replicas ask for with the GPUs the cluster's live nodes have, and refuses to start (``ConfigurationRefused``: one line,
before the port is bound), saying what is missing and which options change it. A sampler replica asking for whole
GPUs (``--sampler-tensor-parallel-size`` workers, one GPU each) needs them all on one node, since its workers are its
own child processes (``adapters.samplers.vllm.parallel``); that is checked node by node. Trainer shards
(``--trainer-shards``) take a whole GPU each (NCCL runs one rank per GPU) and may span nodes. Fractions of GPUs are
checked in total only (Ray packs them onto GPUs as it places the actors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adapters.samplers.options import SamplerOptions
from adapters.trainer.options import TrainerOptions
from shims.errors import ConfigurationRefused

_SLACK = 1e-6
"""Shares such as 0.5 / 3 summed back over three replicas may exceed 1 by a rounding error."""


@dataclass(frozen=True)
class GpuAsk:
    """What the options ask of the cluster's GPUs: ``models`` base models, each with its trainer and its samplers
    (their ``gpus`` None: left to the cluster)."""

    models: int
    trainer: TrainerOptions
    sampler: SamplerOptions

    @property
    def trainer_shards(self) -> int:
        return self.trainer.shards

    @property
    def samplers(self) -> int:
        return self.sampler.count

    @property
    def tensor_parallel_size(self) -> int:
        return self.sampler.tensor_parallel_size

    @property
    def trainer_gpus(self) -> float | None:
        return self.trainer.gpus

    @property
    def sampler_gpus(self) -> float | None:
        return self.sampler.gpus

    @property
    def shards(self) -> int:
        """Trainer processes over all base models."""
        return self.models * self.trainer_shards

    @property
    def replicas(self) -> int:
        return self.models * self.samplers


def gpu_shares(gpus: float, ask: GpuAsk) -> tuple[float, float]:
    """Ray GPUs for each trainer shard and each sampler replica, on a cluster of ``gpus`` GPUs. Unset, they follow
    the cluster: none without GPUs; a whole GPU each (a sampler replica one per tensor-parallel worker) when there are
    enough; on a single GPU an unsharded trainer takes half and the samplers share the other half. Sharded trainers and
    tensor-parallel replicas hold whole GPUs (the samplers beside sharded trainers share what the shards leave):
    where the cluster has too few, ``gpu_refusal`` says what is missing."""
    workers = ask.tensor_parallel_size
    if gpus >= ask.shards + ask.replicas * workers or (gpus >= 1 and workers > 1):
        trainer, sampler = 1.0, float(workers)
    elif gpus > ask.shards and ask.trainer_shards > 1:
        trainer, sampler = 1.0, min(1.0, (gpus - ask.shards) / ask.replicas)
    elif gpus >= 1 and ask.trainer_shards > 1:
        trainer, sampler = 1.0, 1.0
    elif gpus >= 1:
        trainer, sampler = 0.5 / ask.models, 0.5 / ask.replicas
    else:
        trainer, sampler = 0.0, 0.0
    trainer = ask.trainer_gpus if ask.trainer_gpus is not None else trainer
    sampler = ask.sampler_gpus if ask.sampler_gpus is not None else sampler
    if ask.trainer_shards > 1 and trainer != int(trainer):
        raise ConfigurationRefused(
            f"--trainer-shards {ask.trainer_shards} puts each trainer shard on GPUs of its own (NCCL runs one shard per "
            f"GPU), but --trainer-gpus gives each {trainer:g} of one; give each shard a whole GPU, or 0 to shard on CPUs")
    return trainer, sampler


def gpu_refusal(node_gpus: list[float], ask: GpuAsk, trainer_gpus: float, sampler_gpus: float) -> str | None:
    """Why the cluster whose live nodes have ``node_gpus`` GPUs cannot place ``ask``'s trainer shards of
    ``trainer_gpus`` GPUs each and sampler replicas of ``sampler_gpus`` each, or None."""
    have = sum(node_gpus)
    trainers, replicas = ask.shards, ask.replicas
    asked = trainers * trainer_gpus + replicas * sampler_gpus
    parallel = (f" (--sampler-tensor-parallel-size {ask.tensor_parallel_size})" if ask.tensor_parallel_size > 1
                else "")
    if asked > have + _SLACK:
        parts = []
        if replicas * sampler_gpus:
            parts.append(f"{_count(replicas, 'sampler replica')} × {_count(sampler_gpus, 'GPU')}{parallel}")
        if trainers * trainer_gpus:
            sharded = ask.trainer_shards > 1
            parts.append(f"{_count(trainers, 'trainer shard' if sharded else 'trainer')} × "
                         f"{_count(trainer_gpus, 'GPU')}{f' (--trainer-shards {ask.trainer_shards})' * sharded}")
        return (f"the Ray cluster has {_count(have, 'GPU')}, but {' and '.join(parts)} ask for {asked:g}: "
                f"{_count(asked - have, 'GPU')} missing; add GPU nodes, or lower --trainer-shards, --samplers or "
                "--sampler-tensor-parallel-size, or set --sampler-gpus / --trainer-gpus (0: on CPU)")
    if sampler_gpus >= 1 and replicas:
        room = sum(math.floor(gpus / sampler_gpus + _SLACK) for gpus in node_gpus)
        if room < replicas:
            nodes = ", ".join(f"{gpus:g}" for gpus in sorted(node_gpus, reverse=True) if gpus)
            return (f"each sampler replica needs {_count(sampler_gpus, 'GPU')} on one node{parallel}, but the Ray "
                    f"cluster's nodes have {nodes} GPUs: room for {room} of the {_count(replicas, 'replica')}, "
                    f"{replicas - room} missing; add a node with {sampler_gpus:g} GPUs, or lower --samplers or "
                    "--sampler-tensor-parallel-size")
    return None


def _count(amount: float, thing: str) -> str:
    return f"{amount:g} {thing}{'s' * (amount != 1)}"


def node_gpus() -> list[float]:
    """GPUs of each live node of the Ray cluster this process has joined."""
    import ray

    return [float(node["Resources"].get("GPU", 0.0)) for node in ray.nodes() if node.get("Alive")]
