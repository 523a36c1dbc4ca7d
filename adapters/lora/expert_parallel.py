"""Expert parallelism for ``LoRAExperts``: a model's routed experts split over the processes of one sharded trainer,
each holding a contiguous share of every MoE layer's experts — their base weights and every adapter's LoRA pairs on
them (whose gradients and optimizer state follow) — and each (token, expert) row computed on the process that holds
its expert.

A process routes its own tokens (the router's weights are everyone's), then sends every (token, expert) row to its
expert's process in one all-to-all, labelled by the adapter its token goes through (its index among the module's
adapters, which every process adds and removes in the same order); each process runs the rows it received through
its experts, adapter by adapter, as one grouped matmul per projection (``LoRAExperts.compute``), and a second
all-to-all returns each row's output to the process its token came from, which weights and sums them as the single
process does. Nothing is dropped or capped: every row goes where its expert is, however many there are. Both
all-to-alls are differentiable, so backward sends the gradients the same way in reverse, and an expert's LoRA
gradient is complete on the process that holds it, with nothing to sum.

The exchange is a typed interface (``Exchange``): ``torch.distributed`` behind it in the trainer
(``adapters.trainer.parallelize``), anything that moves rows between processes in a test. Every process must call
it in every MoE layer of every pass, also with no row to send, as every collective pairs with the others'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from adapters.lora.experts import LoRAExperts


class Exchange(Protocol):
    """Rows between the processes sharing a model's experts."""

    world: int
    """How many processes share them."""

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` (``[world, n]`` integers: row ``p`` goes to process ``p``) exchanged: row ``p`` of the result is
        what process ``p`` sent this one."""
        ...

    def rows(self, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """``rows`` split in ``send`` (counts per process, in process order) and exchanged: the rows every process
        sent this one, ``receive[p]`` of them from process ``p``, in process order. Differentiable."""
        ...


@dataclass(frozen=True)
class ExpertShare:
    """One process's share of one MoE layer's experts: ``per`` experts to each process in order (the last ones may
    hold fewer, or none), so that expert ``e`` is on process ``e // per``."""

    first: int
    count: int
    per: int
    exchange: Exchange

    @staticmethod
    def of(experts: int, rank: int, exchange: Exchange) -> ExpertShare:
        per = -(-experts // exchange.world)
        first = min(rank * per, experts)
        return ExpertShare(first, min(per, experts - first), per, exchange)

    @property
    def held(self) -> slice:
        """Which of the layer's experts this process holds."""
        return slice(self.first, self.first + self.count)


def dispatched(module: LoRAExperts, share: ExpertShare, hidden: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for this process's tokens (``LoRAExperts.forward``), each (token, expert) row computed
    where its expert is."""
    from adapters.lora.experts import combined  # the module that calls this one: its import would be circular

    world, per = share.exchange.world, share.per
    tokens, top_k = top_k_index.shape
    names = list(module.lora.pairs)
    labels = len(names) + 1  # 0: the base experts alone; i + 1: names[i]
    device = hidden.device
    token_label = torch.zeros(tokens, dtype=torch.long, device=device)
    routing = module.router.active(module.lora.scaling)
    if routing is not None:
        found = [names.index(name) + 1 if name in module.lora else 0 for name, _, _ in routing.groups]
        token_label = torch.repeat_interleave(torch.tensor(found, device=device),
                                              torch.tensor(routing.sizes(tokens), device=device), output_size=tokens)
    expert = top_k_index.reshape(-1)
    owner = torch.div(expert, per, rounding_mode="floor")
    # Sorted by process, then adapter, then the expert's place on its process: what each process receives from this
    # one comes in (adapter, expert) groups.
    key = (owner * labels + token_label.repeat_interleave(top_k)) * per + (expert - owner * per)
    key, order = torch.sort(key, stable=True)
    send_counts = torch.bincount(key, minlength=world * labels * per).view(world, labels * per)
    got_counts = share.exchange.counts(send_counts)
    send, receive = send_counts.sum(1).tolist(), got_counts.sum(1).tolist()
    received = share.exchange.rows(hidden[torch.div(order, top_k, rounding_mode="floor")], send, receive)
    # The rows received, from every process, grouped by (adapter, expert).
    received_key = torch.repeat_interleave(torch.arange(labels * per, device=device).repeat(world),
                                           got_counts.reshape(-1), output_size=received.shape[0])
    regroup = torch.sort(received_key, stable=True)[1]
    rows = received[regroup]
    per_group = got_counts.sum(0).view(labels, per)[:, : share.count]
    outputs, start = [], 0
    for label, counts in enumerate(per_group):
        end = start + int(counts.sum())
        if end > start:
            outputs.append(module.compute(rows[start:end], counts, names[label - 1] if label else None))
        start = end
    # No row here: the empty rows themselves go back, so backward still passes through both exchanges.
    computed = torch.cat(outputs) if outputs else rows
    back = torch.empty_like(computed).index_copy(0, regroup, computed)
    return combined(share.exchange.rows(back, receive, send), order, top_k_weights, hidden.dtype)
