"""LoRA on an ``nn.Linear``: every adapted linear layer holds each adapter's A and B, and a batch's rows go through the
adapter they belong to (``adapters.lora.routing``).

Each adapter's rows are one contiguous slice of the batch; the layer adds each slice's delta ``scale · (x·Aᵀ)·Bᵀ`` to
its slice of the base output and concatenates: two small matmuls per adapter present, no per-row gather or scatter
(PEFT's per-row routing indexed, copied and scattered every row of every layer: ~40% of a GPU step), no host
synchronisation. The scale multiplies the narrow rank-r side, and the sum is the up-projection's own (``addmm``).
Adapters of any rank and any subset of layers coexist: a layer without a given adapter leaves its rows as the base
computes them.

A layer may carry its LoRA as several *slots*, each over a slice of its output rows with its own A and B: hosted
Tinker trains some fused projections as their parts (Qwen3.5's ``in_proj_qkv`` as ``in_proj_q/k/v``, Nemotron's Mamba
``in_proj`` as ``gate_proj`` + ``x_proj``), so that is what an adapter holds (``adapters.lora.targets``).

The LoRA parameters are float32 whatever the base model's dtype (an optimizer's updates are far smaller than a bf16
ulp); the delta is computed in the activations' dtype.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from adapters.lora.routing import Router, Routing


@dataclass(frozen=True)
class Slot:
    """One place an adapter has one LoRA pair: its name in saved files, which weight group it belongs to, and the
    shapes of A ``([experts,] rank, in_features)`` and B ``([experts,] out_features, rank)``."""

    key: str
    """The module path it is saved under (``model.layers.0.self_attn.q_proj``; for experts the projection,
    ``model.layers.1.mlp.experts.gate_proj``)."""
    group: str
    """``attn`` (token mixers: attention of every kind, linear attention, Mamba), ``mlp`` (dense, shared and routed
    experts) or ``unembed`` (the output head): what ``train_attn`` / ``train_mlp`` / ``train_unembed`` select."""
    in_features: int
    out_features: int
    experts: int = 0
    """0: one 2-D pair; otherwise one pair per expert, stored as 3-D tensors."""

    def shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        lead = (self.experts,) if self.experts else ()
        return (*lead, rank, self.in_features), (*lead, self.out_features, rank)

    def initial(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh pair as PEFT initialises one: A uniform like ``nn.Linear``'s default (Kaiming, a=√5, i.e. ±1/√in
        per expert), B zero, so the adapter starts as the base model. Drawn on the CPU from the global generator
        (the caller seeds it), so a seed gives the same adapter on every device."""
        a_shape, b_shape = self.shapes(rank)
        a = torch.empty(a_shape)
        for matrix in a if self.experts else [a]:
            nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
        return a, torch.zeros(b_shape)


class Pairs:
    """The LoRA weights on one module (its ``lora``): per adapter name, one (A, B) per slot and the scale, as float32
    parameters on the module's device. Plain dictionaries, not registered submodules (so not in its state dict): the
    owners (trainer, sampler) hold the parameter lists they train or read."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.pairs: dict[str, list[tuple[nn.Parameter, nn.Parameter]]] = {}
        self.scaling: dict[str, float] = {}
        self.held: slice | None = None
        """Routed experts' pairs: which experts this process holds when they are split over processes
        (``adapters.lora.expert_parallel``); None: all of them."""

    def put(self, name: str, tensors: list[tuple[torch.Tensor, torch.Tensor]], scaling: float,
            device: torch.device, trainable: bool) -> None:
        """Hold ``name``'s pairs (whole: of every expert; this process keeps the experts it ``held``)."""
        if self.held is not None:
            tensors = [(a[self.held].clone(), b[self.held].clone()) for a, b in tensors]  # not views of the whole
        self.pairs[name] = [(nn.Parameter(a.to(device, torch.float32), requires_grad=trainable),
                             nn.Parameter(b.to(device, torch.float32), requires_grad=trainable)) for a, b in tensors]
        self.scaling[name] = scaling

    def remove(self, name: str) -> None:
        self.pairs.pop(name, None)
        self.scaling.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self.scaling


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus any number of named LoRA adapters on it, each with one pair per slot."""

    def __init__(self, base: nn.Linear, router: Router, slots: list[Slot], rows: list[tuple[int, int]]) -> None:
        """``rows``: the output rows each slot covers, in order, together all of them (one slot: the whole)."""
        super().__init__()
        if rows[0][0] != 0 or rows[-1][1] != base.out_features or any(
                a[1] != b[0] for a, b in itertools.pairwise(rows)):
            raise ValueError(f"LoRA slots must cover the output rows in order, got {rows}")
        self.base = base
        self.router = router
        self.lora = Pairs(slots)
        self._dense_cache = _DenseCache()

    @property
    def weight(self) -> torch.Tensor:
        """The base weight, for code that reads it (a tied embedding, transformers' own checks)."""
        return self.base.weight

    def delta(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``name``'s contribution for inputs ``x``, whatever the routing."""
        parts = [nn.functional.linear(low, b) for low, b in self._low_rank(x, name)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def plus_delta(self, y: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
        """``y`` (the base output for ``x``) plus ``name``'s contribution. With one slot the sum is the
        up-projection's own (``addmm``), which writes it in the matmul's output: one pass over a 2048 × 32000
        head output less per step than a separate add (measured on CPU; an in-place ``addmm_`` on ``y`` costs
        more, autograd copying the view's gradient)."""
        pairs = self._low_rank(x, name)
        if len(pairs) > 1:
            return y + torch.cat([nn.functional.linear(low, b) for low, b in pairs], dim=-1)
        low, b = pairs[0]
        return torch.addmm(y.reshape(-1, y.shape[-1]), low.reshape(-1, low.shape[-1]), b.t()).view(y.shape)

    DENSE_SHARE = 4
    """The dense path is taken while the adapters' ranks side by side stay within 1/``DENSE_SHARE`` of the layer's
    narrower side (its extra arithmetic then under half the base layer's)."""
    DENSE_MAX_TOKENS = 1024
    """... and for calls of at most this many tokens (decoding steps, short prompts), where op overhead rather than
    arithmetic is what the per-group path costs."""

    def _dense(self, routing: Routing, x: torch.Tensor) -> _Dense | None:
        """Every group's adapter side by side (made once and kept while the groups' adapters and their tensors
        stay the same, whichever rows they cover), or None where the dense path does not apply: adapters that
        train (an optimizer may change them in place without a version torch can see: fused AdamW), weights that
        are not finite, several slots, a long call, or ranks side by side too wide."""
        if len(self.lora.slots) != 1 or x.numel() > self.DENSE_MAX_TOKENS * x.shape[-1]:
            return None
        pairs = [self.lora.pairs.get(name) if name is not None else None for name, _, _ in routing.groups]
        held = [pair[0] for pair in pairs if pair]
        rank = max((a.shape[0] for a, _ in held), default=0)
        base = self.base
        if (not rank or any(a.requires_grad or b.requires_grad for a, b in held)
                or len(pairs) * rank * self.DENSE_SHARE > min(base.in_features, base.out_features)):
            return None
        names = tuple(name for name, _, _ in routing.groups)
        key = (names, x.device, x.dtype, tuple((id(a), a._version, id(b), b._version, self.lora.scaling[n])
                                               for n, p in zip(names, pairs, strict=True) if p for a, b in p))
        kept = self._dense_cache.entry
        if kept is not None and kept.key == key:
            return kept
        # Every row meets every adapter's weights here (0 · NaN is NaN): one adapter's non-finite weights would
        # reach the rows of all the others. Such an adapter fails its own rows alone, on the per-group path.
        if not all(bool(torch.isfinite(a).all() and torch.isfinite(b).all()) for a, b in held):
            self._dense_cache.entry = None
            return None
        a = torch.zeros((len(pairs) * rank, base.in_features), device=x.device, dtype=x.dtype)
        b = torch.zeros((base.out_features, len(pairs) * rank), device=x.device, dtype=x.dtype)
        for i, (name, pair) in enumerate(zip(names, pairs, strict=True)):
            if pair:
                (pa, pb), = pair
                a[i * rank:i * rank + pa.shape[0]] = pa * self.lora.scaling[name]
                b[:, i * rank:i * rank + pa.shape[0]] = pb
        self._dense_cache.entry = _Dense(key, a, b, rank)
        return self._dense_cache.entry

    def _plus_dense(self, y: torch.Tensor, x: torch.Tensor, routing: Routing, dense: _Dense) -> torch.Tensor:
        """``y`` plus each row's own adapter's contribution, every group at once: x through all the groups' A,
        the blocks of other groups zeroed (``Router.row_groups``), then through all the B (three ops for any number
        of adapters, where the per-group path takes five per group: on a small model decoding 32 rows of 8
        adapters, op overhead rather than arithmetic)."""
        low = nn.functional.linear(x, dense.a)
        groups = self.router.row_groups(routing, x.device)
        # Selected, not multiplied by 0: another adapter's block may overflow on this row (0 · inf is NaN).
        low = torch.where(groups[:, None, :, None], low.reshape(routing.rows, -1, groups.shape[1], dense.rank), 0)
        return torch.addmm(y.reshape(-1, y.shape[-1]), low.reshape(-1, dense.a.shape[0]), dense.b.t()).view(y.shape)

    def _low_rank(self, x: torch.Tensor, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per slot: ``scale · x·Aᵀ`` (the scale on the rank-r side, the narrow one) and the B it goes through."""
        scale = self.lora.scaling[name]
        out = []
        for a, b in self.lora.pairs[name]:
            if a.dtype != x.dtype:
                a, b = a.to(x.dtype), b.to(x.dtype)
            out.append((nn.functional.linear(x, a) * scale, b))
        return out

    def with_adapter(self, x: torch.Tensor, name: str | None) -> torch.Tensor:
        """The layer's output for ``x`` through adapter ``name`` (or the base), independent of the routing — for
        recomputation in backward, after the forward's routing is gone."""
        y = self.base(x)
        return self.plus_delta(y, x, name) if name is not None and name in self.lora else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        routing = self.router.active(self.lora.scaling)
        if routing is None:
            return y
        if len(routing.groups) == 1:
            return self.plus_delta(y, x, routing.groups[0][0])
        if not torch.is_grad_enabled() and (dense := self._dense(routing, x)) is not None:
            return self._plus_dense(y, x, routing, dense)
        # Rows are counted in the batch's tokens flattened row by row: a row of a padded batch is its positions, a
        # row of a packed sequence one token; a layer may see the tokens already flattened (a MoE shared expert).
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        # Split, not sliced: one backward node for every group, where a slice's gradient is the whole batch's size.
        sizes = routing.sizes(flat_x.shape[0])
        parts = [self.plus_delta(y_part, x_part, name) if name in self.lora else y_part
                 for (name, _, _), y_part, x_part in zip(routing.groups, flat_y.split(sizes), flat_x.split(sizes),
                                                         strict=True)]
        return torch.cat(parts).view(y.shape)


@dataclass(frozen=True)
class _Dense:
    """The adapters of a routing's groups side by side, for ``LoRALinear._plus_dense``: A of each group stacked (its
    scale folded in, its rank padded with zeros to ``rank``) and B beside each other; a base group, or one whose
    adapter this layer does not carry, is a block of zeros."""

    key: tuple
    a: torch.Tensor
    """``[groups × rank, in]``."""
    b: torch.Tensor
    """``[out, groups × rank]``."""
    rank: int


class _DenseCache:
    """The last ``_Dense`` of one layer: a decoding batch keeps its routing for many steps."""

    def __init__(self) -> None:
        self.entry: _Dense | None = None


def with_tied_input_side(embeds: torch.Tensor, ids: torch.Tensor, head: LoRALinear) -> torch.Tensor:
    """Input embeddings of a tied model (one matrix embeds and unembeds), with each row's unembedding LoRA applied
    to that shared matrix on the input side too: row ``t`` of scale·B·A is scale·B[t]·A, from the same parameters the
    head uses (so training gives the one matrix one gradient). Rows go by the routing the head's router holds."""
    routing = head.router.active(head.lora.scaling)
    if routing is None:
        return embeds
    flat, flat_ids = embeds.reshape(-1, embeds.shape[-1]), ids.reshape(-1)
    sizes = routing.sizes(flat.shape[0])  # rows counted as in ``LoRALinear.forward``
    parts = []
    for (name, _, _), part, part_ids in zip(routing.groups, flat.split(sizes), flat_ids.split(sizes), strict=True):
        if name in head.lora:
            (a, b), = head.lora.pairs[name]
            rows = nn.functional.embedding(part_ids, b)
            part = part + (rows @ a).to(part.dtype) * head.lora.scaling[name]
        parts.append(part)
    return torch.cat(parts).view(embeds.shape)
