"""How a sharded trainer's adapters are split over its shards, applied once to the plain LoRA model (as torchtitan's
``parallelize`` functions are), so that the passes and the losses never ask whether they are sharded.

``apply_expert_parallel``: every MoE layer's routed experts are split over the shards in contiguous shares; each
shard keeps every adapter's LoRA pairs of its own experts only (so their gradients and optimizer state too), and the
(token, expert) rows travel to their expert's shard and back by all-to-all (``adapters.lora.expert_parallel``). The
experts' base weights are each shard's own rows of them, as FSDP2 loaded them, and never gathered; the rest of the
base model stays FSDP2's (``adapters.trainer.shards.load_base``). An adapter's weights that are not an expert's stay
whole on every shard, their optimizer state split (``AdapterTable``'s ``mine``).

A split adapter is whole again only where it is written: ``whole_tensors`` gathers its experts' pairs on rank 0.
"""

from __future__ import annotations

import torch
from torch import nn

from adapters.lora.expert_parallel import ExpertShare
from adapters.lora.experts import LoRAExperts
from adapters.lora.model import LoRAModel, Pair
from adapters.trainer.shards import Shards


class Collectives:
    """The ``Exchange`` of expert parallelism over the trainer's ``torch.distributed`` group (gloo on CPUs, NCCL on
    GPUs)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        received = torch.empty_like(send)
        dist.all_to_all_single(received, send.contiguous())
        return received

    def rows(self, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        received = rows.new_empty((sum(receive), *rows.shape[1:]))
        if torch.is_grad_enabled() and rows.requires_grad:
            return all_to_all_single(received, rows.contiguous(), receive, send)
        dist.all_to_all_single(received, rows.contiguous(), receive, send)
        return received


def apply_expert_parallel(model: LoRAModel, shards: Shards) -> str | None:
    """Split every routed-experts module of ``model`` over the shards of a sharded trainer (one shard of one holds
    them all, and runs the very code N shards run: how ``bench.gpu_smoke`` checks it on one GPU); returns what this
    shard holds, in words, or None when the model has no routed experts or the trainer is not sharded."""
    experts = [module for module in model.modules.values() if isinstance(module, LoRAExperts)]
    if not shards.sharded or not experts:
        return None
    exchange = Collectives(shards.world)
    for module in experts:
        module.share = ExpertShare.of(module.experts, shards.rank, exchange)
        module.lora.held = module.share.held
    _base_experts_local(model.base, {id(module.base): module.share for module in experts})
    share = experts[0].share
    return (f"experts {share.first}–{share.first + share.count - 1} of {experts[0].experts} in each of "
            f"{len(experts)} MoE layers, with their LoRA pairs")


def _base_experts_local(base: nn.Module, shares: dict[int, ExpertShare]) -> None:
    """Take the routed experts' base weights out of FSDP2's care: each shard keeps its rows of them (FSDP2 splits
    a weight's first dimension as ``ExpertShare`` splits the experts) as plain weights of its own, and a layer's
    forward no longer gathers every expert's weights to every shard, only the rest of the layer's. Done before the
    first pass, while FSDP2 has gathered nothing."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for unit in base.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        if group is None:
            continue
        kept = []
        for param in group.fsdp_params:
            owner, name = param._module_info.module, param._module_info.param_name
            share = shares.get(id(owner))
            if share is None:
                kept.append(param)
                continue
            current = getattr(owner, name)  # the loaded weight (FSDP2 adopts it only at its first pass)
            local = current.to_local() if isinstance(current, DTensor) else current
            if local.shape[0] != share.count:
                raise RuntimeError(f"FSDP2 holds {local.shape[0]} rows of {name} on this shard, where its share of "
                                   f"the experts is {share.count}")
            owner._parameters[name] = nn.Parameter(local.clone(), requires_grad=False)
        group.fsdp_params = kept


def whole_tensors(model: LoRAModel, name: str, shards: Shards) -> dict[str, Pair] | None:
    """``name``'s pairs by slot key, on the CPU, every expert's: on rank 0 (None on the others; a collective, every
    shard calls it together when the model's experts are split)."""
    tensors = model.tensors(name)
    split = model.split_keys() & set(tensors)
    if not split:
        return tensors if shards.writes else None
    parts = shards.gather({key: tensors[key] for key in split})
    if parts is None:
        return None
    for key in split:
        tensors[key] = (torch.cat([part[key][0] for part in parts]), torch.cat([part[key][1] for part in parts]))
    return tensors
