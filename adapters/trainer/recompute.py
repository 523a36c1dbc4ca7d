"""Activation checkpointing per decoder layer: in a pass that trains, a layer keeps only its input, and its inner
activations are recomputed when backward reaches it.

Without it, backward keeps every decoder layer's activations (attention, MLP or experts, and each LoRA's ``x·Aᵀ``)
for the whole batch, so the memory of one datum grows with its length times the number of layers; with it, by about
one layer's activations plus one hidden state per layer. The price is one more forward pass of each layer in
backward, which pays only where activations are large: a pass checkpoints when it holds at least ``min_tokens``
tokens (``--activation-checkpointing-tokens``; 0: never).

A layer's LoRA modules read the batch's routing (``adapters.lora.routing``) when they run; the recomputation runs
after the forward pass has left its routing, so each checkpointed layer keeps the routing it ran with and restores
it while it is recomputed. The layers are found as the model's decoder layers (the ``ModuleList`` of
``get_decoder().layers``), whatever the family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from adapters.lora.routing import Router


class LayerRecompute:
    """Switches activation checkpointing of one model's decoder layers on for the passes that call for it."""

    def __init__(self, base: nn.Module, router: Router, min_tokens: int) -> None:
        self.router = router
        self.min_tokens = min_tokens
        self.active = False
        """Whether the pass being run checkpoints its layers (``for_pass``)."""
        self.layers: nn.ModuleList = base.get_decoder().layers
        if min_tokens > 0:
            for layer in self.layers:
                layer.forward = self._wrapped(layer.forward)

    def for_pass(self, tokens: int) -> _Pass:
        """A context for the forward of one pass over ``tokens`` tokens (padding included): checkpointed if it
        trains and holds at least ``min_tokens``. Its backward, later, recomputes what it checkpointed by itself."""
        return _Pass(self, self.min_tokens > 0 and torch.is_grad_enabled() and tokens >= self.min_tokens)

    def _wrapped(self, forward: Callable) -> Callable:
        def run(*args, **kwargs):
            if not self.active or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            routing = self.router.current

            def again(*a, **k):
                with self.router.restored(routing):
                    return forward(*a, **k)

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
