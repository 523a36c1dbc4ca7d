"""How a trainer's model is made parallel: small functions over the plain model, applied once, in order, by the trainer
(``MultiLoRATrainer``), as torchtitan's ``parallelize`` functions are, so that the passes and the losses never ask
whether or how they are sharded.

``apply_fsdp``: a sharded trainer's base weights are FSDP2's (loaded shard by shard: ``shards.load_base``; one shard
of one gets transformers' plan here), each shard owning a copy of its rows, and the units outside the decoder layers
kept gathered from a pass's forward through its backward.

``apply_expert_parallel``: every MoE layer's routed experts are split over the shards in contiguous shares; each
shard keeps every adapter's LoRA pairs of its own experts only (so their gradients and optimizer state too), and the
(token, expert) rows travel to their expert's shard and back by all-to-all (``adapters.lora.expert_parallel``). The
experts' base weights are each shard's own rows of them, as FSDP2 loaded them, and never gathered. An adapter's
weights that are not an expert's stay whole on every shard, their optimizer state split (``AdapterTable``'s ``mine``).
A split adapter is whole again only where it is written: ``whole_tensors`` gathers its experts' pairs on rank 0.

``apply_activation_checkpointing``: decoder layers that recompute their activations in backward, for the passes that
call for it (``adapters.trainer.recompute``).
"""

from __future__ import annotations

import torch
from torch import nn

from adapters.lora.expert_parallel import ExpertShare
from adapters.lora.experts import LoRAExperts
from adapters.lora.model import LoRAModel, Pair
from adapters.trainer.recompute import LayerRecompute
from adapters.trainer.shards import Shards


def apply_fsdp(base: nn.Module, shards: Shards) -> None:
    """Make a sharded trainer's loaded base model (``shards.load_base``) ready for its passes; a plain trainer's is
    left as it is."""
    if not shards.sharded:
        return
    if shards.world > 1:
        _own_copies(base)
    else:
        # transformers does not shard over one process; its plan is applied here, so one process runs the very code
        # N shards run (how the sharded path is checked on a single GPU: bench.gpu_smoke).
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed import DistributedConfig
        from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism

        base.config.distributed_config = DistributedConfig(fsdp_size=1)
        apply_fully_sharded_data_parallelism(base, _OneMesh(init_device_mesh(shards.device.type, (1,))))
        _tied_head_in_its_unit(base)
    _gathered_through_backward(base)


def apply_activation_checkpointing(model: LoRAModel, min_tokens: int | None) -> LayerRecompute:
    """Decoder layers that keep only their input in passes that call for it and recompute the rest in backward:
    passes of at least ``min_tokens`` tokens (0: never), or (None) those whose activations would not fit. After
    ``apply_expert_parallel``: a layer whose experts are split recomputes to its end, so that its all-to-alls run
    again on every shard alike."""
    return LayerRecompute(model.base, model.router, min_tokens, whole_layers=experts_split(model))


def experts_split(model: LoRAModel) -> bool:
    """Whether the model's routed experts are split over processes (``apply_expert_parallel``)."""
    return any(isinstance(module, LoRAExperts) and module.share is not None for module in model.modules.values())


class _OneMesh:
    """The one-process mesh, as transformers' FSDP plan asks for its meshes."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh

    def get_mesh(self, name: str):
        return self.mesh


def _tied_head_in_its_unit(model: nn.Module) -> None:
    """Keep a tied head tied once transformers' plan is applied to a loaded model: the plan puts the embedding (with
    the final norm) in one unit, and the head, outside it, kept the weight it had, which the root unit then took as
    a weight of its own (FSDP2 refuses that at the first pass). Sharded loading ties the weights again after the plan;
    here the head shares the embedding unit's weight, as FSDP2 would have had it in that unit."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if not getattr(model, "all_tied_weights_keys", None) or head is None or embed is None:
        return
    root = model._get_fsdp_state()._fsdp_param_group
    stray = [param for param in root.fsdp_params if param._module_info.module is head] if root else []
    owner = next((param for group in _param_groups(embed) for param in group.fsdp_params
                  if param._module_info.module is embed), None)
    if not stray or owner is None:
        return
    root.fsdp_params = [param for param in root.fsdp_params if param not in stray]
    _forget(stray)
    owner._module_info.shared_modules.append(head)
    owner._module_info.shared_param_names.append("weight")
    head._parameters["weight"] = embed.weight


def _param_groups(module: nn.Module) -> list:
    """The FSDP2 parameter groups of the unit ``module`` belongs to (itself, or the unit it was grouped in)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return []
    group = module._get_fsdp_state()._fsdp_param_group
    return [group] if group is not None else []


def _gathered_through_backward(model: nn.Module) -> None:
    """Keep the units outside the decoder layers (the final norm with the head, the embeddings), which transformers'
    plan keeps gathered after the forward, gathered through the backward too, until ``Shards.settle``. FSDP2 would
    free them once the head's backward is done and gather them again for the norm's; but a shard whose datums add
    nothing to the loss (none at all, or only forward-only ones) runs no backward through the head, frees nothing and
    gathers nothing, and its collectives would no longer pair with the others'."""
    from torch.distributed.fsdp import FSDPModule

    layers = {id(layer) for layer in model.get_decoder().layers}
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module) not in layers:
            module.set_reshard_after_backward(False, recurse=False)


def _own_copies(model: nn.Module) -> None:
    """Give every shard of a weight memory of its own. On the CPU, a weight read from a safetensors file is a view
    into the file's memory map of the whole tensor: the shard reads only its rows, yet would keep the file mapped and
    hold rows it never uses once the page cache has them (and a model file changed on disk would change the weights
    in use). Each sharded weight is copied out, before FSDP2 first runs and adopts the module's weights."""
    from torch.distributed.tensor import DTensor

    copies: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            local = param.to_local()
            if local.untyped_storage().nbytes() <= local.numel() * local.element_size():
                continue
            if id(param) not in copies:  # a weight two modules share (a tied head) stays shared
                copy = DTensor.from_local(local.clone(), param.device_mesh, param.placements, run_check=False,
                                          shape=param.shape, stride=param.stride())
                copies[id(param)] = nn.Parameter(copy, requires_grad=param.requires_grad)
            module._parameters[name] = copies[id(param)]


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
        _forget([param for param in group.fsdp_params if param not in kept])
        group.fsdp_params = kept


def _forget(params: list) -> None:
    """Let FSDP2 drop parameters taken out of its groups: each one's load hook on its module would keep it alive, with
    its storage (at world size 1 a whole copy of the weight)."""
    for param in params:
        param._post_load_hook_handle.remove()


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
