"""Multi-LoRA execution: every adapted ``nn.Linear`` holds each adapter's A and B, and a batch's rows go through the
adapter they belong to.

The trainer sorts a batch's rows by adapter, so each adapter's rows are one contiguous slice; a layer adds each
slice's delta ``scale · (x·Aᵀ)·Bᵀ`` to its slice of the base output and concatenates. That is two small matmuls per
adapter present, no per-row gather or scatter (PEFT's per-row routing indexed, copied and scattered every row of every
layer: ~40% of a GPU step), no host synchronisation, and one plain add when the whole batch has one adapter.
Adapters of any rank and any subset of target layers coexist: a layer without a given adapter leaves its rows as the
base computes them.

The LoRA parameters are float32 whatever the base model's dtype (an optimizer's updates are far smaller than a bf16
ulp); the delta is computed in the activations' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from adapters.lora.files import lora_key


@dataclass(frozen=True)
class Routing:
    """Which adapter each row of the current batch uses: ``(name or None, first row, end row)`` slices in row order,
    covering the batch (None: the base model)."""

    groups: tuple[tuple[str | None, int, int], ...]

    @staticmethod
    def of(names: list[str | None]) -> Routing:
        """The slices of consecutive equal names (the caller sorts rows by adapter so each has one slice)."""
        groups: list[tuple[str | None, int, int]] = []
        for row, name in enumerate(names):
            if groups and groups[-1][0] == name:
                groups[-1] = (name, groups[-1][1], row + 1)
            else:
                groups.append((name, row, row + 1))
        return Routing(tuple(groups))


class Router:
    """The routing of the forward pass being run, shared by every LoRA layer of one model."""

    def __init__(self) -> None:
        self.current: Routing | None = None

    @contextmanager
    def routing(self, names: list[str | None] | None) -> Iterator[None]:
        previous, self.current = self.current, (Routing.of(names) if names else None)
        try:
            yield
        finally:
            self.current = previous


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus any number of named LoRA adapters on it."""

    def __init__(self, base: nn.Linear, router: Router) -> None:
        super().__init__()
        self.base = base
        self.router = router
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        self.scaling: dict[str, float] = {}
        self._pairs: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        """The same parameters as ``lora_a`` / ``lora_b``, looked up without ``nn.Module`` attribute machinery (the
        lookup ran per adapter, layer and decoding step)."""

    @property
    def weight(self) -> torch.Tensor:
        """The base weight, for code that reads it (a tied embedding, transformers' own checks)."""
        return self.base.weight

    def add(self, name: str, rank: int, scaling: float) -> None:
        """A new adapter as PEFT initialises one: A uniform like ``nn.Linear``'s default (Kaiming, a=√5), B zero, so
        it starts as the base model. Drawn on the CPU from the global generator (the caller seeds it), then moved,
        so a seed gives the same adapter on every device."""
        a = torch.empty(rank, self.base.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.put(name, a, torch.zeros(self.base.out_features, rank), scaling, trainable=True)

    def put(self, name: str, a: torch.Tensor, b: torch.Tensor, scaling: float, trainable: bool = False) -> None:
        """Install an adapter with given matrices, as float32 parameters on the base layer's device (``trainable``
        false: a sampler's adapter, which gets no gradient)."""
        device = self.base.weight.device
        self.lora_a[name] = nn.Parameter(a.to(device, torch.float32), requires_grad=trainable)
        self.lora_b[name] = nn.Parameter(b.to(device, torch.float32), requires_grad=trainable)
        self.scaling[name] = scaling
        self._pairs[name] = (self.lora_a[name], self.lora_b[name])

    def remove(self, name: str) -> None:
        if name in self.scaling:
            del self.lora_a[name], self.lora_b[name], self.scaling[name], self._pairs[name]

    def delta(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``name``'s contribution for inputs ``x``, whatever the routing."""
        a, b = self._pairs[name]
        if a.dtype != x.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
        return nn.functional.linear(nn.functional.linear(x, a), b) * self.scaling[name]

    def with_adapter(self, x: torch.Tensor, name: str | None) -> torch.Tensor:
        """The layer's output for ``x`` through adapter ``name`` (or the base), independent of the routing — for
        recomputation in backward, after the forward's routing is gone."""
        y = self.base(x)
        return y + self.delta(x, name) if name is not None and name in self.scaling else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        routing = self.router.current
        if routing is None or not any(name in self.scaling for name, _, _ in routing.groups):
            return y
        if len(routing.groups) == 1:
            return y + self.delta(x, routing.groups[0][0])
        parts = [y[lo:hi] + self.delta(x[lo:hi], name) if name in self.scaling else y[lo:hi]
                 for name, lo, hi in routing.groups]
        return torch.cat(parts)


def with_tied_input_side(embeds: torch.Tensor, ids: torch.Tensor, head: LoRALinear) -> torch.Tensor:
    """Input embeddings of a tied model (one matrix embeds and unembeds), with each row's unembedding LoRA applied
    to that shared matrix on the input side too: row ``t`` of scale·B·A is scale·B[t]·A, from the same parameters the
    head uses (so training gives the one matrix one gradient). Rows go by the routing the head's router holds."""
    routing = head.router.current
    if routing is None or not any(name in head.scaling for name, _, _ in routing.groups):
        return embeds
    parts = []
    for name, lo, hi in routing.groups:
        part = embeds[lo:hi]
        if name in head.scaling:
            rows = nn.functional.embedding(ids[lo:hi], head.lora_b[name])
            part = part + (rows @ head.lora_a[name]).to(part.dtype) * head.scaling[name]
        parts.append(part)
    return torch.cat(parts)


def install(layers: dict[str, LoRALinear], name: str, tensors: dict[str, torch.Tensor], scaling: float) -> None:
    """Put a saved adapter (tensors named by ``adapter_files.lora_key``) into the layers it names. A tensor naming no
    adaptable layer is an error: it would be silently dropped."""
    used = set()
    for path, layer in layers.items():
        keys = lora_key(path, "A"), lora_key(path, "B")
        if all(key in tensors for key in keys):
            layer.put(name, tensors[keys[0]], tensors[keys[1]], scaling)
            used.update(keys)
    unknown = sorted(set(tensors) - used)
    if unknown:
        for layer in layers.values():
            layer.remove(name)
        raise ValueError(f"{len(unknown)} tensors name no layer this sampler can adapt, e.g. {unknown[0]}")


def wrap_linears(model: nn.Module, leaf_names: set[str], router: Router) -> dict[str, LoRALinear]:
    """Replace every ``nn.Linear`` whose attribute name is in ``leaf_names`` with a ``LoRALinear`` around it;
    returns them by module path (``model.layers.0.self_attn.q_proj``, ``lm_head``), in the model's order."""
    targets = [(path, module) for path, module in model.named_modules()
               if path.rsplit(".", 1)[-1] in leaf_names and isinstance(module, nn.Linear)]
    wrapped = {}
    for path, module in targets:
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapped[path] = LoRALinear(module, router)
        setattr(parent, attribute, wrapped[path])
    return wrapped
