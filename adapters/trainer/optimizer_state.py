"""A run's optimizer state as a checkpoint holds it, whole, and as each shard of a sharded trainer holds it: only for
the parameters that shard steps (``Adapter.owned``).

A checkpoint's ``optimizer.pt`` is always the single trainer's ``optimizer.state_dict()``: one parameter group, its
state indexed by the run's parameters in the model's order. So a checkpoint written by N shards loads on M, or on
one: saving gathers the shards' parts on rank 0 (``whole``), loading keeps each shard's part of the whole
(``part``). A parameter split by expert over the shards (``Adapter.held``) has its state split the same way: its
shares are concatenated in rank order, and each shard keeps its experts' rows.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.trainer.shards import Shards
from adapters.trainer.table import Adapter


def whole(adapter: Adapter, shards: Shards) -> dict[str, Any] | None:
    """The run's whole optimizer state, on rank 0 (None on the others). Sharded, it is gathered from every shard: a
    collective, so every shard calls this together."""
    local = adapter.optimizer.state_dict()
    if adapter.owned is None:
        return local
    mine = {adapter.owned[index]: {key: value.cpu() if isinstance(value, torch.Tensor) else value
                                   for key, value in state.items()}
            for index, state in local["state"].items() if index < len(adapter.owned)}
    parts = shards.gather(mine)
    if parts is None:
        return None
    state: dict[int, dict[str, Any]] = {}
    for part in parts:  # in rank order: a held parameter's shares (its experts) follow each other
        for index in sorted(part):
            kept = state.get(index)
            state[index] = part[index] if kept is None else {
                key: torch.cat([kept[key], value]) if _per_expert(value) else kept[key]
                for key, value in part[index].items()}
    group = {**local["param_groups"][0], "params": list(range(len(adapter.params)))}
    return {"state": dict(sorted(state.items())), "param_groups": [group]}


def part(saved: dict[str, Any], adapter: Adapter) -> dict[str, Any]:
    """What of a whole saved state this process's optimizer takes: the state of the parameters it steps, renumbered
    as its optimizer lists them (a shard that steps none keeps its placeholder's empty state)."""
    if adapter.owned is None:
        return saved
    listed = len(saved["param_groups"][0]["params"])
    if len(saved["param_groups"]) != 1 or listed != len(adapter.params):
        raise ValueError(f"the optimizer state is for {listed} parameters, and the adapter has {len(adapter.params)}")
    state = {new: _share(saved["state"][old], adapter.held.get(old))
             for new, old in enumerate(adapter.owned) if old in saved["state"]}
    group = {**saved["param_groups"][0], "params": list(range(max(len(adapter.owned), 1)))}
    return {"state": state, "param_groups": [group]}


def _per_expert(value: Any) -> bool:
    """Whether a state value is a parameter's own shape (a moment, a momentum), not a step count."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _share(state: dict[str, Any], held: slice | None) -> dict[str, Any]:
    """A parameter's saved state, of the experts this shard holds of it (``Adapter.held``; None: all)."""
    if held is None:
        return state
    return {key: value[held].clone() if _per_expert(value) else value for key, value in state.items()}
