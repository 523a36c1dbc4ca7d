"""One request's custom loss over its datums: the per-datum losses to sum and the metrics to reduce, also across the
shards of a sharded trainer that each ran some of the request's datums (``adapters.trainer.forward``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from shims.custom_loss.graph import CustomLoss
from shims.custom_loss.run import device_time, over_time, run_datum


class CustomLossBatch:
    """One request's custom loss over its datums: the per-datum losses to sum, and the metrics reduced as the SDK's
    client-side path reduces them."""

    def __init__(self, loss: CustomLoss, device: torch.device) -> None:
        self.loss = loss
        self.device = device
        self.deadline = device_time(device) + loss.limits.max_seconds
        """The request's custom-loss time, forward and backward of every datum, runs out then: device time
        (``device_time``), counted from when the device has finished the shared forward queued before."""
        self._sums: dict[str, float] = {}
        self._count = 0

    def datum(self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        total, metrics = run_datum(self.loss, logprobs, inputs, self.deadline)
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._count += 1
        return total

    def gradients(self, total: torch.Tensor, logprobs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradient of the request's loss ``total`` with respect to each datum's ``logprobs``: the loss's own
        backward, run once, within the request's time (checked before each of its backward nodes; each is bounded
        as its step was). The trainer takes the model's side of backward from these (``adapters.trainer.forward``)."""
        stops = {lp.grad_fn for lp in logprobs}
        handles = []

        def check(_grads: tuple) -> None:
            if device_time(self.device) > self.deadline:
                raise over_time(self.loss, "its backward")

        seen: set = set()
        pending = [total.grad_fn]
        try:
            while pending:  # the loss's own nodes: from its result down to the logprobs, never into the model
                node = pending.pop()
                if node is None or node in seen or node in stops:
                    continue
                seen.add(node)
                handles.append(node.register_prehook(check))
                pending.extend(next_node for next_node, _ in node.next_functions)
            return list(torch.autograd.grad(total, logprobs, allow_unused=True))
        finally:
            for handle in handles:
                handle.remove()

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
