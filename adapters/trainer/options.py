"""The trainers' options: what each base model's trainer asks of the Ray cluster (its shards and their resources) and
of itself (its batches, its runs). Declared here once, each with its default, help and check (``shims.option``);
``compat_server.config.ServerConfig`` holds them as ``trainer``, and the CLI makes their flags (``--trainer-cpus``,
``--max-adapters``, ...). The pool, each trainer group and each trainer process are given this object whole."""

# ruff: noqa: RUF009 -- option() is dataclasses.field() with the option's metadata; a dict default is copied.

from __future__ import annotations

from dataclasses import dataclass

from shims.option import ABOVE_ZERO, at_least, option


@dataclass(frozen=True)
class TrainerOptions:
    """Ray resources each trainer actor (each shard) asks for, how it computes, and what one trainer holds. ``gpus``
    unset is decided at start from the cluster (``compat_server.devices``); the pool is given it decided."""

    resources: dict[str, float] = option(
        {}, flag="--trainer-resource",
        help="a custom Ray resource each trainer needs (repeatable), to place trainers on the nodes started with it, "
             "e.g. --trainer-resource trainer_node=1")
    cpus: float = option(1.0, flag="--trainer-cpus", check=at_least(0),
                         help="Ray CPUs reserved by each trainer actor, for placement; how many threads it computes "
                              "with is --trainer-threads (default: %(default)s)")
    gpus: float | None = option(
        None, flag="--trainer-gpus",
        help="Ray GPUs reserved by each trainer actor (default: 1 when the cluster has a GPU for each trainer and "
             "sampler, half of one GPU on a single-GPU machine, else 0)")
    threads: int | None = option(
        None, flag="--trainer-threads", check=at_least(1),
        help="torch threads in each trainer process (default: every CPU it may use on its node, divided among the "
             "shards of one trainer there; the samplers' threads share the same CPUs in time, idle threads "
             "sleeping; set both options to split the CPUs instead)")
    shards: int = option(
        1, flag="--trainer-shards", check=at_least(1),
        help="processes each base model's trainer is split over, one per device (a GPU each on a GPU cluster; they "
             "may span nodes): each holds 1/N of the base model's weights (FSDP2) and runs 1/N of every batch; "
             "--trainer-cpus, --trainer-gpus and --trainer-resource are per shard (default: %(default)s, the whole "
             "model in one process)")
    placement_timeout: float = option(
        120.0, check=ABOVE_ZERO,
        help="seconds the shards of a sharded trainer (--trainer-shards) may wait for the Ray cluster to have room for "
             "them, all at once, before the start is refused naming what is missing; raise it on a cluster whose "
             "autoscaler adds nodes (default: %(default)s)")
    max_batch_tokens: int = option(
        131072, check=at_least(1),
        help="most input tokens in one trainer batch; forward_backward calls of different training runs waiting "
             "together share a batch up to this size, and a single larger call is refused (default: %(default)s)")
    max_batch_datums: int = option(
        32768, check=at_least(1),
        help="most datums in one trainer batch; calls waiting together share a batch up to this many, and a single "
             "call with more is refused before its datums are decoded (default: %(default)s)")
    max_adapters: int = option(
        64, "most training runs (LoRA adapters) held at once per base model (default: %(default)s)", check=at_least(1))
    activation_checkpointing_tokens: int | None = option(
        None, check=at_least(0),
        help="a trainer batch of at least this many tokens (padding included) that trains keeps no decoder layer's "
             "activations: each layer's are recomputed in backward (a third more arithmetic), so memory grows with "
             "the length by about one layer's activations; 0: never (default: a batch whose activations would take "
             "more than a third of the memory free on its device, measured per token when the trainer starts)")

    activation_memory_mib: int | None = option(
        None, check=at_least(1),
        help="most memory, in MiB, one training pass of a trainer (each shard) may count on for its activations, "
             "whatever its device has free (for a device shared with samplers or other processes); a pass whose "
             "activations would take over a third of it even with every layer recomputed is refused with a "
             "clear error, before it runs (default: the memory free on its device at that moment)")

    def bundle(self) -> dict[str, float]:
        """One shard's Ray resources, as a placement group bundle."""
        wanted = {"CPU": self.cpus, "GPU": self.gpus or 0.0, **self.resources}
        return {name: amount for name, amount in wanted.items() if amount > 0}
