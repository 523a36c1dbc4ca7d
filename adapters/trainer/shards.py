"""One trainer spread over several processes (``--trainer-shards N``): the ``torch.distributed`` side of each shard.

A base model too large for one device is split over N processes, one per device, each holding 1/N of its frozen
weights (FSDP2: ``fully_shard`` per decoder layer, as transformers' own FSDP plan lays it out, loaded shard by shard
so that no process ever holds the whole model). A layer's weights are gathered while the layer runs and freed after.

On a mixture of experts each shard holds its share of every MoE layer's routed experts, base weights and every
adapter's LoRA pairs on them, and tokens travel to their experts' shard and back (expert parallelism,
``adapters.trainer.parallelize``). Every other LoRA weight is held by every shard, and stays equal because every
shard sums the same gradients (data parallelism for the adapters, FSDP for the base). Their optimizer state is split
(ZeRO's first stage): each shard steps its share of a run's parameters, balanced by size, and keeps their moments
alone, then the shards sum the stepped weights, each counted by its owner (``adapters.trainer.optim``); a training
checkpoint gathers the shares (and the experts' pairs) into the single trainer's files
(``adapters.trainer.optimizer_state``). A mixed batch is split across the shards by datum, balanced by tokens; each shard runs the forward and backward of its
datums, the shards sum each request's loss and the adapters' gradients, and rank 0 answers with every datum's output.

Collectives pair up only when every shard makes the same calls in the same order, so a shard never skips a pass: one
with no datum of a batch runs a one-token row of the base model, and in backward every shard goes through every layer
(``probe``). Failures that belong to one request (bad input, a custom loss that raises in forward or backward, a loss
that is not finite) are found by the shard that meets them and agreed on by all before backward, so the request fails
alone. A failure inside the shared passes themselves (out of device memory) cannot be pinned on one request without
the other shards, which are then waiting in a collective: the shard exits, and the pool restarts the group
(``adapters.trainer.group``).

``Shards`` of world size 1 without a spec is the plain single-process trainer: every collective is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from adapters.trainer.interface import SEE_ALL_GPUS, ShardSpec

log = logging.getLogger("compat_server.trainer")

T = TypeVar("T")

BUCKET_ELEMENTS = 1 << 23
"""Gradient elements summed over the shards in one collective (32 MiB in float32)."""

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""How long a shard waits in one collective for the others. A shard that died is noticed by the pool long before
(its process is gone); this only bounds a wait no process failure explains."""


class Shards:
    """How one trainer process takes part in its group: which datums it runs and the collectives that make N
    processes act as one trainer. Without a spec: the plain trainer, alone, every collective a no-op."""

    def __init__(self, spec: ShardSpec | None, device: torch.device) -> None:
        self.spec = spec
        self.rank = spec.rank if spec else 0
        self.world = spec.world if spec else 1
        self.device = device
        self.backend = ""
        if spec is not None:
            import torch.distributed as dist

            self.backend = "nccl" if device.type == "cuda" else "gloo"
            if dist.is_initialized():  # a process that already joined this group (a second trainer in one process)
                if (dist.get_rank(), dist.get_world_size()) != (spec.rank, spec.world):
                    raise RuntimeError(f"this process is rank {dist.get_rank()} of {dist.get_world_size()} already, "
                                       f"not {spec.rank} of {spec.world}")
            else:
                dist.init_process_group(self.backend, init_method=f"tcp://{spec.address}", rank=spec.rank,
                                        world_size=spec.world, timeout=COLLECTIVE_TIMEOUT,
                                        device_id=device if device.type == "cuda" else None)
        self._objects = None
        """The process group objects travel through: on GPUs a gloo group beside NCCL's, so that a pickled object
        (a run's optimizer state, gathered to be saved) is never staged in device memory."""
        if spec is not None and self.backend == "nccl" and spec.world > 1:
            import torch.distributed as dist

            self._objects = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)

    @property
    def sharded(self) -> bool:
        """Whether the base model is sharded (FSDP), even over one process."""
        return self.spec is not None

    @property
    def writes(self) -> bool:
        """Whether this shard writes the group's files (the adapters are the same on every shard; a training
        checkpoint's optimizer state is gathered to it first)."""
        return self.rank == 0

    def peers_here(self) -> int:
        """How many shards of this trainer (this one included) run on this machine: they run every pass together,
        so they divide its CPUs between them (``adapters.cpu_threads``)."""
        if self.world == 1:
            return 1
        here = machine_id()
        return sum(machine == here for machine in self.everywhere(here))

    def everywhere(self, value: T) -> list[T]:
        """Every shard's ``value`` (picklable), on every shard."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        values: list = [None] * self.world
        dist.all_gather_object(values, value, group=self._objects)
        return values

    def mine(self, sizes: list[int], first: int = 0) -> list[int]:
        """This shard's share of items of ``sizes`` (indices, in order): the largest first to the shard with the
        least so far (ties: from shard ``first`` on), so that the shards share the work (a batch's datums, by tokens)
        or the memory (a run's parameters, by elements, ``first`` turning with each run) evenly."""
        if self.world == 1:
            return list(range(len(sizes)))
        load = [0] * self.world
        owner = [0] * len(sizes)
        for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            rank = min(range(self.world), key=lambda r: (load[r], (r - first) % self.world))
            owner[index] = rank
            load[rank] += sizes[index]
        return [i for i, rank in enumerate(owner) if rank == self.rank]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the shards, in place (every shard gets the sum)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor

    def sum_all(self, tensors: list[torch.Tensor]) -> None:
        """Each of ``tensors`` summed over the shards, in place, a bucket of about ``BUCKET_ELEMENTS`` at a time: few
        collectives, and never more than one bucket of memory beside the tensors themselves."""
        if self.world == 1:
            return
        bucket: list[torch.Tensor] = []
        size = 0
        for tensor in tensors:
            if bucket and size + tensor.numel() > BUCKET_ELEMENTS:
                self._sum_bucket(bucket)
                bucket, size = [], 0
            bucket.append(tensor)
            size += tensor.numel()
        if bucket:
            self._sum_bucket(bucket)

    def _sum_bucket(self, bucket: list[torch.Tensor]) -> None:
        flat = self.sum(torch.cat([t.reshape(-1) for t in bucket]))
        for tensor, summed in zip(bucket, torch.split(flat, [t.numel() for t in bucket]), strict=True):
            tensor.copy_(summed.view_as(tensor))

    def gather(self, value: T) -> list[T] | None:
        """Every shard's ``value`` (picklable), on rank 0 (None on the others)."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        values: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(value, values, dst=0, group=self._objects)
        return values

    def agreed(self, ok: bool) -> bool:
        """Whether every shard is ``ok``: for what each shard does alone that the others must know of before they go
        on together (reading a checkpoint from a shared disk that one shard may not see, scoring on rank 0)."""
        if self.world == 1:
            return ok
        failed = self.sum(torch.tensor([0.0 if ok else 1.0], device=self.device))
        return float(failed.item()) == 0.0

    def agreed_pass(self, fits: bool, checkpointed: bool) -> tuple[bool, bool]:
        """Whether a training pass fits on every shard, and whether any shard checkpoints it (then every shard
        must: ``adapters.trainer.passes``), in one all-reduce before the pass's first collective."""
        if self.world == 1:
            return fits, checkpointed
        votes = self.sum(torch.tensor([0.0 if fits else 1.0, 1.0 if checkpointed else 0.0], device=self.device))
        return float(votes[0].item()) == 0.0, float(votes[1].item()) > 0.0

    def through_root(self, model: nn.Module, run: Callable[[], T]) -> T:
        """``run()`` as the forward of the sharded model's root module, so that FSDP2 prepares the pass in the root
        module's hooks: the trainer runs the embedding and the decoder itself (``adapters.trainer.passes``), not the
        model's own forward. The head is scored after, chunk by chunk, on weights FSDP2 keeps gathered from the
        forward through the backward (``adapters.trainer.parallelize.apply_fsdp``)."""
        if not self.sharded:
            return run()
        model.forward = run  # an instance attribute, looked up by nn.Module.__call__ before the class's forward
        try:
            return model()
        finally:
            del model.forward

    def settle(self, model: nn.Module) -> None:
        """End a pass: free every gathered weight (FSDP2 keeps the units outside the decoder layers gathered after a
        forward, and ``apply_fsdp`` after a backward too) and FSDP2's records of the pass, which only a backward
        clears otherwise, so that scoring and forward-only batches leave nothing behind. Between passes each shard
        holds only its share."""
        if self.sharded:
            model.reset_iter_state()

    def fatal(self, exc: BaseException) -> None:
        """A shared pass failed on this shard: the others are waiting for it in a collective, and the pass cannot be
        resumed. Exit, so the pool restarts the group (its runs reloaded from their checkpoints)."""
        log.error("trainer shard %d of %d: a shared pass failed (%s: %s); the shard exits so that its group restarts",
                  self.rank, self.world, type(exc).__name__, str(exc)[:500], exc_info=exc)
        logging.shutdown()
        os._exit(70)


def machine_id() -> str:
    """Which machine this process runs on, for counting the shards that share its CPUs: the kernel's boot id, which
    the containers and Ray nodes of one machine share and cloned machines do not (else the host name)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def load_base(location: str, dtype: torch.dtype, shards: Shards) -> nn.Module:
    """The base model in ``dtype`` on the shard's device. A shard of N > 1 loads it sharded: built on the meta device,
    transformers' own FSDP plan for it applied while loading (the embeddings, each decoder layer, and the final norm
    with the head, each one FSDP2 unit), each shard reading from the checkpoint only the rows it keeps. The rest of
    its parallelism is applied after (``adapters.trainer.parallelize``)."""
    from transformers import AutoModelForCausalLM

    if shards.world == 1:
        return AutoModelForCausalLM.from_pretrained(location, dtype=dtype).to(shards.device)
    from transformers.distributed import DistributedConfig

    # transformers puts the model on cuda:LOCAL_RANK; a shard's device index is its own (adapters.trainer.group).
    os.environ["LOCAL_RANK"] = str(shards.device.index or 0)
    return AutoModelForCausalLM.from_pretrained(location, dtype=dtype,
                                                distributed_config=DistributedConfig(fsdp_size=shards.world))


def resident_bytes(model: nn.Module) -> int:
    """Bytes of memory the base model's weights hold in this process now: each distinct storage once, a shard's
    local rows and any gathered weights not yet freed."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def local_device() -> torch.device:
    """The device this trainer process computes on: its GPU if it has one, else the CPU. A shard of a sharded
    trainer sees every GPU of its node (so that NCCL can reach its peers directly) and finds its own among them by
    the id Ray gave it (``adapters.trainer.group``)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    import ray

    ids = ray.get_gpu_ids() if ray.is_initialized() else []
    if ids and os.environ.get(SEE_ALL_GPUS) == "1":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = visible.split(",").index(str(ids[0])) if visible else int(ids[0])
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cuda", torch.cuda.current_device())
