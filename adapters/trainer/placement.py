"""What each base model's trainer asks of the Ray cluster and of itself: its shards, their resources and limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerPlacement:
    """Ray resources each trainer actor (each shard) asks for; on a GPU machine a trainer takes one GPU."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    resources: dict[str, float] | None = None
    max_batch_tokens: int = 131072
    """Most input tokens one mixed forward_backward batch may hold (several requests join while it stays under)."""
    max_adapters: int = 64
    """Most training runs (LoRA adapters) one base model's trainer holds at once."""
    recompute_tokens: int = 4096
    """Training batches of at least this many tokens checkpoint each decoder layer (``adapters.trainer.recompute``)."""
    shards: int = 1
    """Processes (devices) each base model's trainer is split over (``adapters.trainer.shards``)."""
    placement_timeout: float = 120.0
    """Seconds the shards' placement group may wait for room in the cluster before the start is refused."""

    def bundle(self) -> dict[str, float]:
        """One shard's Ray resources, as a placement group bundle."""
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus, **(self.resources or {})}
        return {name: amount for name, amount in wanted.items() if amount > 0}
