"""LoRA on a mixture of experts whose weights are 3-D parameters (transformers' experts modules): one low-rank pair
per expert and projection, computed grouped over the tokens routed to each expert.

transformers (5.x) stores a MoE layer's routed experts as one module with 3-D parameters — ``gate_up_proj`` (or
``up_proj`` alone) and ``down_proj`` — and describes their layout on the module (``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``, ``_apply_gate``, ``act_fn``). ``LoRAExperts`` wraps such a module and, for
rows with an adapter, runs the experts itself: the (token, expert) pairs are sorted by expert once, and every
projection is a grouped matmul over those groups — the base weight's, then ``scale · (x·Aₑᵀ)·Bₑᵀ`` as two more
grouped matmuls through the expert's A and B. No Python loop over tokens or experts (a loop over experts only where
the grouped kernel cannot take the shapes). Rows without an adapter run through the wrapped module itself.

An adapter holds, per expert, hosted Tinker's pairs: ``gate_proj`` and ``up_proj`` (one each, even where the model
fuses them into ``gate_up_proj``, interleaved for gpt-oss) and ``down_proj``; A is ``(experts, rank, in)`` and B
``(experts, out, rank)``, the shapes hosted Tinker exports.
"""

from __future__ import annotations

import torch
from torch import nn

from adapters.lora.expert_parallel import ExpertShare, dispatched
from adapters.lora.linear import Pairs, Slot
from adapters.lora.routing import Router


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module of 3-D weights this file can adapt."""
    return (hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "num_experts")
            and isinstance(getattr(module, "down_proj", None), nn.Parameter))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ weight[g]`` for every group, the groups ending at ``offsets`` (int32 cumulative ends).
    The grouped kernel needs every stride, forward and backward, a multiple of 16 bytes, so every dimension too;
    other shapes (a rank of 2, an odd expert size) take one matmul per expert."""
    size = x.element_size()
    dims = (weight.shape[-2], weight.shape[-1])
    strides = [stride for t in (x, weight) for stride in t.stride() if stride != 1]
    if all(n * size % 16 == 0 for n in (*dims, *strides)) and x.data_ptr() % 16 == weight.data_ptr() % 16 == 0:
        return nn.functional.grouped_mm(x, weight, offs=offsets)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[lo:hi] @ weight[e] for e, (lo, hi) in enumerate(zip(starts, ends, strict=True)) if hi > lo]
    return torch.cat(parts) if parts else x.new_zeros((0, weight.shape[-1]))


def combined(rows: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's output: its (token, expert) rows' outputs (``rows``, in the sorted ``order`` of the flattened
    ``top_k_weights``), weighted by their routing weights and summed, in ``dtype``. Put back in token order, then one
    batched ``[1, k] @ [k, features]`` a token: weighted and summed in one op, without a weighted copy of every row
    (measured on CPU, 2,048 tokens top-8: 15 ms forward and backward, where multiply, unsort and sum took 19)."""
    tokens, top_k = top_k_weights.shape
    by_token = torch.empty_like(rows).index_copy(0, order, rows).view(tokens, top_k, -1)
    return torch.bmm(top_k_weights.to(rows.dtype).unsqueeze(1), by_token).squeeze(1).to(dtype)


class LoRAExperts(nn.Module):
    """A frozen transformers experts module plus any number of named LoRA adapters on its experts."""

    def __init__(self, base: nn.Module, router: Router, path: str) -> None:
        super().__init__()
        self.base = base
        self.router = router
        first = base.gate_up_proj if base.has_gate else base.up_proj
        experts = int(first.shape[0])
        # (in, out) of the first projection and of down_proj, whichever way round the module stores them.
        in_first, out_first = (first.shape[1], first.shape[2]) if base.is_transposed else (first.shape[2],
                                                                                             first.shape[1])
        in_down, out_down = ((base.down_proj.shape[1], base.down_proj.shape[2]) if base.is_transposed
                             else (base.down_proj.shape[2], base.down_proj.shape[1]))
        hidden = out_first // 2 if base.has_gate else out_first
        slots = [Slot(f"{path}.{name}", "mlp", int(in_first), int(hidden), experts)
                 for name in (("gate_proj", "up_proj") if base.has_gate else ("up_proj",))]
        slots.append(Slot(f"{path}.down_proj", "mlp", int(in_down), int(out_down), experts))
        self.lora = Pairs(slots)
        self.share: ExpertShare | None = None
        """This process's share of the experts when a model's experts are split over processes (expert parallelism,
        ``adapters.lora.expert_parallel``); None: it computes every expert."""

    @property
    def experts(self) -> int:
        """How many routed experts the module has (in the whole model, whichever of them this process holds)."""
        return self.lora.slots[0].experts

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.share is not None:
            return dispatched(self, self.share, hidden, top_k_index, top_k_weights)
        routing = self.router.active(self.lora.scaling)
        if routing is None:
            return self.run(hidden, top_k_index, top_k_weights, None)
        sizes = routing.sizes(hidden.shape[0])  # the tokens flattened row by row; split: one backward node
        parts = [self.run(h, i, w, name if name in self.lora else None)
                 for (name, _, _), h, i, w in zip(routing.groups, hidden.split(sizes), top_k_index.split(sizes),
                                                  top_k_weights.split(sizes), strict=True)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def run(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            name: str | None) -> torch.Tensor:
        """The experts' output for ``hidden`` (tokens × features) through adapter ``name`` (None: the base experts,
        computed the same way, so that an adapter whose B is zero gives exactly the base output; and on any shapes,
        where transformers' own grouped path needs aligned ones)."""
        top_k = top_k_index.shape[1]
        expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
        counts = torch.bincount(expert_ids, minlength=self.experts)
        # index_select, not indexing: its backward adds the rows' gradients (index_add_, 2–4% of a 128-expert step
        # on CPU faster than indexing's index_put_; deterministic under torch.use_deterministic_algorithms)
        rows = hidden.index_select(0, order // top_k)
        return combined(self.compute(rows, counts, name), order, top_k_weights, hidden.dtype)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, name: str | None) -> torch.Tensor:
        """Each row of ``x`` through its expert, unweighted: the rows sorted by expert, ``counts[e]`` of them for the
        ``e``-th expert this process holds (all of them, unless they are split over processes:
        ``adapters.lora.expert_parallel``), through adapter ``name``'s pairs on it (None: the base alone)."""
        base = self.base
        experts = slice(0, counts.numel())
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        scale = self.lora.scaling[name] if name is not None else 0.0
        pairs = [(a.to(x.dtype), b.to(x.dtype)) for a, b in self.lora.pairs[name]] if name is not None else []

        def low(inputs: torch.Tensor, first: int, last: int) -> torch.Tensor:
            """``scale · x·Aᵀ`` of pairs ``first`` to ``last`` side by side: the pairs on one input (gate and up) go
            through one grouped matmul, and the scale is applied on the rank-r side, the narrow one."""
            a = pairs[first][0] if last == first + 1 else torch.cat([a for a, _ in pairs[first:last]], dim=1)
            return grouped_mm(inputs, a.transpose(1, 2), offsets) * scale

        def up(lows: torch.Tensor, index: int, column: int = 0) -> torch.Tensor:
            """Pair ``index``'s B applied to the ``column``-th rank-wide block of ``lows``."""
            b = pairs[index][1]
            rank = b.shape[2]
            return grouped_mm(lows[:, column * rank:(column + 1) * rank], b.transpose(1, 2), offsets)

        def project(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            weight = weight[experts]
            out = grouped_mm(inputs, weight if base.is_transposed else weight.transpose(1, 2), offsets)
            if bias is None:
                return out
            expert_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                                 output_size=inputs.shape[0])
            return out + bias[experts][expert_ids]

        if base.has_gate:
            inner = project(x, base.gate_up_proj, base.gate_up_proj_bias if base.has_bias else None)
            if pairs:
                lows = low(x, 0, 2)
                gate_delta, up_delta = up(lows, 0, 0), up(lows, 1, 1)
                deltas = torch.cat([gate_delta, up_delta], dim=-1)
                if not base.is_concatenated:  # interleaved: gate₀ up₀ gate₁ up₁ … (reshaped, not stacked: the
                    # gradients the grouped matmuls get back are then whole rows, as their kernel needs)
                    deltas = deltas.view(-1, 2, gate_delta.shape[-1]).transpose(1, 2).reshape(deltas.shape)
                inner = inner + deltas
            inner = base._apply_gate(inner)
        else:
            inner = project(x, base.up_proj, base.up_proj_bias if base.has_bias else None)
            inner = base.act_fn(inner + up(low(x, 0, 1), 0) if pairs else inner)
        out = project(inner, base.down_proj, base.down_proj_bias if base.has_bias else None)
        last = len(pairs) - 1
        return out + up(low(inner, last, last + 1), last) if pairs else out
