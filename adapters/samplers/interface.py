"""The samplers' two interfaces, and what crosses them: ``SamplerReplica``, a replica as the server calls it, and
``SamplerBackend``, the one small interface every sampler backend implements inside a replica.

A backend holds one base model and serves sampling requests for it and for any LoRA adapter saved for sampling,
loading adapters on demand — from their checkpoint directory, or from memory where the trainer handed them over
(``AdapterTensors`` to the transformers sampler, ``PeftTensors`` to vLLM's) — and keeping a bounded number resident. Backends, each a
subclass of ``SamplerBackend``: ``adapters.samplers.hf.sampler.TransformersSampler`` (CPU default, GPU fallback) and
``adapters.samplers.vllm.sampler.VLLMSampler`` (GPU, ``[gpu]`` extra). Each replica is a Ray actor around one
(``adapters.samplers.replica.SamplerActor``), which ``adapters.samplers.pool`` creates from its import path and calls
through ``SamplerReplica`` alone: no backend is imported in the server process.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from adapters.lora.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from shims.sampling.job import SampleJob, SampleResult, TokenEvent

OnToken = Callable[[TokenEvent], None]
"""Called with each token as it is sampled (streaming); possibly from a backend's generation thread."""


class Restarting(RuntimeError):
    """Raised inside a sampler actor that is about to be replaced (it stops, and Ray starts it again): the call did
    not run. Its caller sees ``adapters.actors.ActorRestarting`` and waits for the new replica."""


class EngineDead(RuntimeError):
    """A backend's engine died under a running request (vLLM's engine process): the request failed and this replica
    cannot serve until it is restarted. Defined here, not beside the backend, because Ray raises it again in the
    server process, which unpickles it by its class's module and must not import a backend to do so."""


@dataclass(frozen=True)
class AdapterRef:
    """Which LoRA weights to sample from. ``key`` names the weights (a sampler checkpoint's tinker:// path, or an
    ephemeral save's id): an opaque name, which backends compare and show but never look inside. ``version`` grows
    when the weights behind a key change (``inflight`` sampling clients share one mutable key), and a resident adapter
    with an older version is reloaded."""

    key: str
    directory: str
    version: int = 0
    tensors: Any = field(default=None, compare=False)
    """The weights themselves where no directory holds them (``directory`` is then empty): an ``AdapterTensors`` or
    ``PeftTensors``, a Ray object reference to one, or a sharded trainer's tuple of references to each shard's part,
    which a backend fetches when it loads the adapter (``resolve``)."""

    def resolve(self) -> AdapterTensors | PeftTensors:
        """``tensors`` fetched (``fetched``)."""
        return fetched(self.tensors)


@dataclass(frozen=True)
class AdapterTensors:
    """A LoRA adapter's weights as the trainer hands them to samplers in memory (an unnamed save: no file written):
    every pair by the LoRA model's slot keys, trainer and sampler sharing one model code (``adapters.lora.model``),
    as float32 numpy arrays (Ray's object store passes those without copying), with the adapter's scale and rank."""

    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    scaling: float
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


@dataclass(frozen=True)
class PeftTensors:
    """A LoRA adapter's sampler directory held in memory instead of written (an unnamed save to vLLM's samplers,
    which load PEFT directories): ``adapter_model.safetensors``'s tensors by their stored names, as numpy arrays, and
    ``adapter_config.json`` as a dict — what ``save_for_sampler`` would have written."""

    state: dict[str, np.ndarray]
    config: dict

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.state.values())

    def write(self, directory: Path) -> None:
        """Write them as that directory (which exists), as ``save_for_sampler`` would have."""
        from safetensors.numpy import save_file

        save_file({name: np.ascontiguousarray(t) for name, t in self.state.items()}, str(directory / ADAPTER_WEIGHTS))
        (directory / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True))


def fetched(tensors: Any) -> AdapterTensors | PeftTensors:
    """Weights handed over in memory, whole: as they are; fetched from Ray's object store (on the reader's node,
    read in place); or, from a sharded trainer, every shard's part fetched from where that shard put it, ``joined``."""
    if isinstance(tensors, AdapterTensors | PeftTensors):
        return tensors
    import ray

    if isinstance(tensors, tuple):
        return joined(ray.get(list(tensors)))
    return ray.get(tensors)


def joined(parts: list[AdapterTensors | PeftTensors]) -> AdapterTensors | PeftTensors:
    """One adapter from the parts a sharded trainer's shards hand over, in rank order: rank 0's holds all but the
    other shards' experts, each other shard's its own experts alone (the next ones: ``ExpertShare``). In PEFT's
    naming every expert's tensors have names of their own and are taken as they are; by slot key an expert slot's
    parts are joined along the experts (a copy)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, PeftTensors):
        return PeftTensors({name: t for part in parts for name, t in part.state.items()}, first.config)
    pieces: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for part in parts:
        for key, pair in part.pairs.items():
            pieces.setdefault(key, []).append(pair)
    return AdapterTensors({key: pair[0] if len(pair) == 1 else (np.concatenate([a for a, _ in pair]),
                                                               np.concatenate([b for _, b in pair]))
                           for key, pair in pieces.items()}, first.scaling, first.rank)


@dataclass(frozen=True)
class SamplerFacts:
    backend: str
    vocab_size: int
    max_context: int
    device: str
    max_resident: int
    dtype: str = ""
    """What the base model is held in (float32, bfloat16, ...)."""
    tensor_parallel_size: int = 1
    """Workers the model is split over (``--sampler-tensor-parallel-size``; vLLM only)."""
    torch_threads: tuple[int, ...] = ()
    """The torch threads of each process computing for the replica, read in it (``SamplerBackend.torch_threads``)."""


class SamplerBackend(Protocol):
    """What a sampler backend offers the replica that holds it (``SamplerActor``). Backends subclass it, so a type
    checker holds each to it (and ``tests/test_sampler_interface.py`` checks their signatures match)."""

    dead: str | None
    """Why the backend can no longer serve (its actor is then replaced), or None."""

    def facts(self) -> SamplerFacts: ...

    async def torch_threads(self) -> list[int]:
        """The torch threads each process that computes for this replica runs with (``torch.get_num_threads()``,
        read where the work runs: one entry per vLLM worker), for the ready line and the metrics."""
        ...

    async def sample(self, adapter: AdapterRef | None, job: SampleJob, on_token: OnToken | None = None) -> SampleResult:
        """Run one request (``job.num_samples`` sequences). Backends batch concurrent calls together. With
        ``on_token``, every token is reported as soon as it is sampled (what streaming responses are built from)."""
        ...

    def resident(self) -> list[str]:
        """Keys of the adapters loaded now, least recently used first."""
        ...

    def stats(self) -> dict:
        """Counters for ``/api/v1/metrics``; always includes ``resident_adapters``."""
        ...

    async def close(self) -> None: ...


class SamplerReplica(Protocol):
    """One sampler replica as the pool calls it: a Ray actor holding one backend, whose coroutines run concurrently
    (concurrent requests reach the backend together, which batches them). ``SamplerActor`` implements it."""

    async def facts(self) -> SamplerFacts:
        """What the replica serves, and the torch threads it computes with; raises the ``ConfigurationRefused`` its
        backend met at start."""
        ...

    async def ready(self) -> None:
        """Answers once this replica can serve; raises ``Restarting`` while it is about to be replaced."""
        ...

    async def stats(self) -> dict:
        """The backend's counters, its limits, and where it runs (node, pid)."""
        ...

    async def sample(self, adapter: AdapterRef | None, job: SampleJob) -> SampleResult:
        """Run one request (``job.num_samples`` sequences)."""
        ...

    def stream(self, adapter: AdapterRef | None, job: SampleJob) -> AsyncIterator[list[TokenEvent] | SampleResult]:
        """The same request as ``sample``, yielding the tokens as they come (every token available at that moment,
        as one list), then the ``SampleResult``."""
        ...


SAMPLER_REPLICA_CLASS = "adapters.samplers.replica:SamplerActor"
"""The class that implements ``SamplerReplica``, imported only in the replicas' actors."""


def choose_backend(requested: str, has_gpu: bool) -> str:
    """``auto`` picks vLLM where a GPU and the ``[gpu]`` extra are present, and transformers everywhere else."""
    if requested != "auto":
        return requested
    if has_gpu:  # looked up, not imported: only the replicas' processes load vLLM
        return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    return "transformers"


@dataclass
class _Slot:
    slot_id: int
    version: int
    in_use: int = 0


@dataclass(frozen=True)
class Acquired:
    slot_id: int
    load: bool
    """The weights must be (re)loaded into ``slot_id`` before use."""
    evicted: tuple[int, ...]
    """Slots to unload first, least recently used first."""


class AllAdaptersBusy(RuntimeError):
    """Every resident adapter serves a running request, so none can make room; wait for a ``release``."""


class ResidentAdapters:
    """Least-recently-used bookkeeping of the adapters a backend holds, at most ``capacity`` at once.

    Every load gets a fresh slot id (an adapter name in PEFT, a ``lora_int_id`` in vLLM), so a reloaded adapter never
    reuses the id of weights that changed. Adapters in use by running requests are never evicted: when newer weights
    arrive under a key still in use, the old slot is retired and unloaded once its last user releases it. Retired
    slots count toward ``capacity``, so a backend never holds more than ``capacity`` adapters (vLLM's CPU cache is
    that size, and would otherwise evict one on its own).
    Thread-safe: the transformers backend acquires in a worker thread while metrics read ``keys`` elsewhere.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("an adapter capacity of at least 1 is needed")
        self.capacity = capacity
        self._slots: dict[str, _Slot] = {}  # insertion order = recency, least recent first
        self._retired: dict[int, _Slot] = {}  # replaced while in use: unloaded when released
        self._unload: list[int] = []
        self._next_id = 1
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._slots)

    def acquire(self, ref: AdapterRef) -> Acquired:
        """Mark ``ref`` in use (call ``release`` with the slot id when done) and say what to load and unload."""
        with self._lock:
            evicted, self._unload = self._unload, []
            slot = self._slots.pop(ref.key, None)
            if slot is not None and slot.version >= ref.version:
                slot.in_use += 1
                self._slots[ref.key] = slot
                return Acquired(slot.slot_id, False, tuple(evicted))
            if slot is not None:  # stale weights: replaced now, unloaded as soon as nothing uses them
                if slot.in_use:
                    self._retired[slot.slot_id] = slot
                else:
                    evicted.append(slot.slot_id)
            while len(self._slots) + len(self._retired) >= self.capacity:  # retired slots are still loaded
                victim = next((k for k, s in self._slots.items() if not s.in_use), None)
                if victim is None:
                    self._unload = evicted  # still owed to the backend
                    raise AllAdaptersBusy(f"all {self.capacity} resident adapters are in use")
                evicted.append(self._slots.pop(victim).slot_id)
            new = _Slot(self._next_id, ref.version, in_use=1)
            self._next_id += 1
            self._slots[ref.key] = new
            return Acquired(new.slot_id, True, tuple(evicted))

    def release(self, key: str, slot_id: int) -> None:
        with self._lock:
            retired = self._retired.get(slot_id)
            if retired is not None:
                retired.in_use -= 1
                if not retired.in_use:
                    del self._retired[slot_id]
                    self._unload.append(slot_id)
                return
            slot = self._slots.get(key)
            if slot is not None and slot.slot_id == slot_id and slot.in_use:
                slot.in_use -= 1

    def forget(self, key: str, slot_id: int) -> None:
        """Drop a slot whose load failed."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.slot_id == slot_id:
                del self._slots[key]
