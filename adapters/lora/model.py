"""One base model with any number of named LoRA adapters on it: what the trainer and the transformers sampler both
hold, so that an adapter is built, loaded and computed the same way in each.

An adapter's tensors are exchanged by slot key (``adapters.lora.linear.Slot``): ``{key: (A, B)}``, A
``([experts,] rank, in)`` and B ``([experts,] out, rank)``; ``adapters.lora.files`` turns them into files in either
naming and back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from adapters.lora.experts import LoRAExperts
from adapters.lora.files import LANGUAGE_MODEL, AdapterNaming
from adapters.lora.linear import LoRALinear, Slot
from adapters.lora.routing import Router
from adapters.lora.targets import GROUPS, wrap_model
from shims.errors import UserError

Pair = tuple[torch.Tensor, torch.Tensor]
"""One slot's (A, B)."""


class LoRAModel:
    """A base model whose adaptable modules (``adapters.lora.targets``) carry named adapters, routed by row."""

    def __init__(self, base: nn.Module) -> None:
        self.base = base
        self.router = Router()
        self.modules = wrap_model(base, self.router)
        """Every LoRA module, by module path, in the model's order."""
        self.head: LoRALinear = base.get_output_embeddings()
        self.tied = self.head.weight is base.get_input_embeddings().weight
        """One matrix embeds tokens and unembeds them: an unembedding LoRA then acts on both sides."""
        self.slots: dict[str, Slot] = {slot.key: slot for module in self.modules.values()
                                       for slot in module.lora.slots}

    @property
    def head_key(self) -> str:
        """The output head's slot key (``lm_head``)."""
        return self.head.lora.slots[0].key

    def naming(self, vision_language: bool = False) -> AdapterNaming:
        """How this model's adapters are named in files (``adapters.lora.files``), by the class of the model loaded
        (the same in the trainer and the sampler, a vision-language checkpoint's text model included) and, stored,
        whether the checkpoint is a vision-language one (``adapters.models.resolve.is_vision_language``)."""
        fused = {path: [slot.key for slot in module.lora.slots] for path, module in self.modules.items()
                 if len(module.lora.slots) > 1 and not isinstance(module, LoRAExperts)}
        return AdapterNaming(self.slots, self.head_key, type(self.base).__name__, self.tied, fused,
                             LANGUAGE_MODEL if vision_language else None)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def describe(self) -> dict[str, list[str]]:
        """What a LoRA adapts, by weight group: each distinct weight once, its layer numbers left out
        (``self_attn.q_proj``, ``mlp.experts.gate_proj ×128 experts``) — for capabilities and the ready line."""
        names: dict[str, dict[str, None]] = {group: {} for group in GROUPS}
        for slot in self.slots.values():
            name = re.sub(r"^.*?layers\.\d+\.", "", slot.key)
            names[slot.group][f"{name} ×{slot.experts} experts" if slot.experts else name] = None
        return {group: list(found) for group, found in names.items()}

    def add(self, name: str, rank: int, scaling: float, groups: Iterable[str]) -> None:
        """A fresh adapter on every slot of ``groups`` (B = 0: it starts as the base model), its A drawn from the
        global generator in the model's order (the caller seeds it)."""
        chosen = set(groups)
        for module in self.modules.values():
            slots = module.lora.slots  # one module's slots share its group (adapters.lora.targets)
            if slots[0].group in chosen:
                module.lora.put(name, [slot.initial(rank) for slot in slots], scaling, self.device, True)

    def put(self, name: str, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
            trainable: bool = False) -> None:
        """Install an adapter from its tensors by slot key, once ``check`` finds them fitting: anything else is a
        ``UserError`` and installs nothing."""
        for module, pairs in self.check(tensors):
            module.lora.put(name, pairs, scaling, self.device, trainable)

    def check(self, tensors: dict[str, Pair]) -> list[tuple[LoRALinear | LoRAExperts, list[Pair]]]:
        """Each module ``tensors`` adapt, with its pairs, if every tensor names a slot of this model with the slot's
        shape for one common rank and a module's slots come all or none; otherwise a ``UserError`` (a tensor no slot
        takes would be silently dropped)."""
        unknown = sorted(set(tensors) - set(self.slots))
        if unknown:
            raise UserError(f"{len(unknown)} adapter tensors name no weight this model's LoRA adapts, e.g. "
                            f"{unknown[0]}")
        ranks = {a.shape[-2] for a, _ in tensors.values()}
        if len(ranks) != 1:
            raise UserError(f"the adapter's tensors have different ranks ({sorted(ranks)})")
        rank = ranks.pop()
        chosen: list[tuple[LoRALinear | LoRAExperts, list[Pair]]] = []
        for module in self.modules.values():
            present = [slot.key for slot in module.lora.slots if slot.key in tensors]
            if not present:
                continue
            if len(present) != len(module.lora.slots):
                missing = next(slot.key for slot in module.lora.slots if slot.key not in tensors)
                raise UserError(f"the adapter has {present[0]} but not {missing}, which is adapted with it")
            for slot in module.lora.slots:
                a, b = tensors[slot.key]
                want = slot.shapes(rank)
                if tuple(a.shape) != want[0] or tuple(b.shape) != want[1]:
                    raise UserError(f"adapter tensor {slot.key} has shapes {list(a.shape)}, {list(b.shape)}; this "
                                    f"model needs {list(want[0])}, {list(want[1])}")
            chosen.append((module, [tensors[slot.key] for slot in module.lora.slots]))
        return chosen

    def remove(self, name: str) -> None:
        for module in self.modules.values():
            module.lora.remove(name)

    def params(self, name: str) -> list[nn.Parameter]:
        """A and B of every slot ``name`` has, in the model's order (the order optimizer state is saved in)."""
        return [p for module in self.modules.values() if name in module.lora
                for pair in module.lora.pairs[name] for p in pair]

    def held(self, name: str) -> list[slice | None]:
        """For each parameter of ``params(name)``, in order: the experts of it this process holds where the model's
        experts are split over processes (``adapters.lora.expert_parallel``); None for a whole one."""
        return [module.lora.held for module in self.modules.values() if name in module.lora
                for _ in module.lora.pairs[name] for _ in range(2)]

    def first_experts(self) -> dict[str, int]:
        """Of each slot whose experts are split over processes, the index of the first this process holds."""
        return {slot.key: module.lora.held.start for module in self.modules.values() if module.lora.held is not None
                for slot in module.lora.slots}

    def split_keys(self) -> set[str]:
        """The slots whose pairs this process holds only a share of (its experts')."""
        return {slot.key for module in self.modules.values() if module.lora.held is not None
                for slot in module.lora.slots}

    def tensors(self, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``name``'s pairs by slot key, detached, on the CPU (of a split slot, this process's experts alone:
        ``split_keys``)."""
        return {slot.key: (a.detach().cpu(), b.detach().cpu()) for module in self.modules.values()
                if name in module.lora
                for slot, (a, b) in zip(module.lora.slots, module.lora.pairs[name], strict=True)}

    def slot_groups(self, keys: Iterable[str]) -> set[str]:
        """The weight groups the slots ``keys`` belong to."""
        return {self.slots[key].group for key in keys if key in self.slots}
