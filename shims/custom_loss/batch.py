"""One request's custom loss over its datums: the per-datum losses to sum and the metrics to reduce, also across the
shards of a sharded trainer that each ran some of the request's datums (``adapters.trainer.forward``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from shims.custom_loss.graph import CustomLoss
from shims.custom_loss.run import run_datum


class CustomLossBatch:
    """One request's custom loss over its datums: the per-datum losses to sum, and the metrics reduced as the SDK's
    client-side path reduces them."""

    def __init__(self, loss: CustomLoss) -> None:
        self.loss = loss
        self._sums: dict[str, float] = {}
        self._count = 0

    def datum(self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        total, metrics = run_datum(self.loss, logprobs, inputs)
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._count += 1
        return total

    def tally(self) -> tuple[dict[str, float], int]:
        """The metric sums and the datums counted so far: what ``combined_metrics`` reduces, also across the shards
        of a sharded trainer that each ran some of the request's datums."""
        return dict(self._sums), self._count


def combined_metrics(tallies: Iterable[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of one request from the tallies of its datums (``CustomLossBatch.tally``): sums, ``:mean`` keys
    divided by the number of datums."""
    sums: dict[str, float] = {}
    count = 0
    for part, datums in tallies:
        for key, value in part.items():
            sums[key] = sums.get(key, 0.0) + value
        count += datums
    return {key: value / count if key.endswith(":mean") else value for key, value in sums.items()}
