"""Activation checkpointing per decoder layer: in a pass that trains, a layer keeps only its input, and its inner
activations are recomputed when backward reaches it.

Without it, backward keeps every decoder layer's activations (attention, MLP or experts, and each LoRA's ``x·Aᵀ``)
for the whole batch, so the memory of one datum grows with its length times the number of layers; with it, by about
one layer's activations plus one hidden state per layer. The price is one more forward pass of each layer in
backward, which pays only where activations would not fit: by default a pass checkpoints when what it would keep
exceeds its share of the memory free on its device (``adapters.trainer.memory``); ``--activation-checkpointing-tokens
N`` makes it every pass of at least N tokens instead (0: never).

A layer's LoRA modules read the batch's routing (``adapters.lora.routing``) when they run; the recomputation runs
after the forward pass has left its routing, so each checkpointed layer keeps the routing it ran with and restores
it while it is recomputed. The layers are found as the model's decoder layers (the ``ModuleList`` of
``get_decoder().layers``), whatever the family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from adapters.lora.routing import Router
from adapters.trainer.memory import ActivationBudget


class LayerRecompute:
    """Switches activation checkpointing of one model's decoder layers on for the passes that call for it."""

    def __init__(self, base: nn.Module, router: Router, min_tokens: int | None, whole_layers: bool) -> None:
        """``whole_layers``: a layer is recomputed to its end, never stopped once the tensors backward needs are back
        (torch's early stop): for layers whose collectives must all run again on every shard alike (expert
        parallelism's all-to-alls)."""
        self.router = router
        self.whole_layers = whole_layers
        self.min_tokens = min_tokens
        """Passes of at least this many tokens checkpoint (0: none); None: those whose activations do not fit
        ``budget``."""
        self.budget: ActivationBudget | None = None
        """What the model keeps per token, once measured (``adapters.trainer.memory``); until then (and for a
        probe's passes) nothing checkpoints by memory."""
        self.active = False
        """Whether the pass being run checkpoints its layers (``for_pass``)."""
        self.layers: nn.ModuleList = base.get_decoder().layers
        for layer in self.layers:
            layer.forward = self._wrapped(layer.forward)

    def checkpoints(self, tokens: int, free: int | None = None) -> bool:
        """Whether a pass that trains over ``tokens`` tokens (padding included) checkpoints its layers, with
        ``free`` bytes free for it (None: read now; ``ActivationBudget.free``)."""
        if self.min_tokens is None:
            return self.budget is not None and not self.budget.fits(tokens, free)
        return self.min_tokens > 0 and tokens >= self.min_tokens

    def for_pass(self, checkpointed: bool) -> _Pass:
        """A context for the forward of one pass: ``checkpointed`` (``checkpoints``, decided once before the pass)
        if it trains. Its backward, later, recomputes what it checkpointed by itself."""
        return _Pass(self, torch.is_grad_enabled() and checkpointed)

    def _wrapped(self, forward: Callable) -> Callable:
        def run(*args, **kwargs):
            if not self.active or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            routing = self.router.current

            def again(*a, **k):
                with self.router.restored(routing):
                    return forward(*a, **k)

            with set_checkpoint_early_stop(not self.whole_layers):
                return checkpoint(again, *args, use_reentrant=False, **kwargs)

        return run


class _Pass:
    def __init__(self, owner: LayerRecompute, on: bool) -> None:
        self.owner, self.on = owner, on

    def __enter__(self) -> bool:
        self.previous, self.owner.active = self.owner.active, self.on
        return self.on

    def __exit__(self, *exc) -> None:
        self.owner.active = self.previous
