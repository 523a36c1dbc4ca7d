"""The GPUs a configuration asks the Ray cluster for, checked when the server starts.

An actor asking for GPUs that no node has is never placed: Ray waits for them forever, and the server would sit
unready with no word of why. So before any actor is created the server compares what its trainers and sampler
replicas ask for with the GPUs the cluster's live nodes have, and refuses to start (``ConfigurationRefused``: one line,
before the port is bound), saying what is missing and which options change it. A sampler replica asking for whole
GPUs (``--sampler-tensor-parallel-size`` workers, one GPU each) needs them all on one node, since its workers are its
own child processes (``adapters.samplers.vllm.parallel``); that is checked node by node. Fractions of GPUs are checked
in total only (Ray packs them onto GPUs as it places the actors).
"""

from __future__ import annotations

import math

_SLACK = 1e-6
"""Shares such as 0.5 / 3 summed back over three replicas may exceed 1 by a rounding error."""


def gpu_refusal(node_gpus: list[float], trainers: int, trainer_gpus: float, replicas: int, sampler_gpus: float,
                tensor_parallel_size: int = 1) -> str | None:
    """Why the cluster whose live nodes have ``node_gpus`` GPUs cannot place ``trainers`` trainers of
    ``trainer_gpus`` GPUs each and ``replicas`` sampler replicas of ``sampler_gpus`` each, or None."""
    have = sum(node_gpus)
    asked = trainers * trainer_gpus + replicas * sampler_gpus
    parallel = f" (--sampler-tensor-parallel-size {tensor_parallel_size})" if tensor_parallel_size > 1 else ""
    if asked > have + _SLACK:
        parts = []
        if replicas * sampler_gpus:
            parts.append(f"{_count(replicas, 'sampler replica')} × {_count(sampler_gpus, 'GPU')}{parallel}")
        if trainers * trainer_gpus:
            parts.append(f"{_count(trainers, 'trainer')} × {_count(trainer_gpus, 'GPU')}")
        return (f"the Ray cluster has {_count(have, 'GPU')}, but {' and '.join(parts)} ask for {asked:g}: "
                f"{_count(asked - have, 'GPU')} missing; add GPU nodes, or lower --samplers or "
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
