"""Dimuon, the optimizer family Tinker offers beside AdamW (``DimuonOptimizerConfig`` / ``DimuonParams``).

What Tinker documents (tinker-docs ``types/dimuonparams``; SDK 0.38 ``types/optimizer.py``): per step the caller gives
``learning_rate``, ``beta1`` ("EMA coefficient for the momentum") and ``grad_clip_norm`` (global norm, nonpositive =
off); the learning rate is "applied to a direction with Frobenius norm sqrt(rank), with rank correction applied
uniformly to all LoRA matrices"; the direction comes from a matrix-sign (polar) computation whose iteration count
and normalisation epsilon are internal. Implemented here, for every LoRA matrix ``W`` (``A``: r×in, ``B``: out×r):

    M ← beta1 · M + (1 − beta1) · G                      (G: the clipped gradient; M starts at 0)
    D = sqrt(r) · polar(M) / ‖polar(M)‖_F                (polar(M) = U Vᵀ from M's SVD, singular values ≤ EPS·σ_max
                                                           dropped; D = 0 when M = 0; for a routed expert's 3-D
                                                           pair, per expert)
    W ← W − learning_rate · D

The polar factor is computed exactly (an SVD of a rank-r matrix is cheap) instead of by Newton–Schulz iterations;
for a full-rank M, ‖polar(M)‖_F is already sqrt(r), and the scaling keeps every LoRA matrix's step at that norm
whatever its shape (the uniform rank correction). No weight decay: ``DimuonParams`` has none.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-4
"""Relative singular-value cut-off: directions of M weaker than this are treated as absent, not amplified to unit
strength (a rank-deficient gradient, e.g. from fewer trained tokens than the LoRA rank, carries float32 noise there)."""


def direction(momentum: torch.Tensor, rank: int) -> torch.Tensor:
    """The step direction of one LoRA matrix: its momentum's polar factor with Frobenius norm sqrt(rank). A routed
    expert's pair is one matrix per expert (``(experts, rows, columns)``): each expert's gets its own direction."""
    if not momentum.numel():
        return torch.zeros_like(momentum)
    u, s, vh = torch.linalg.svd(momentum.double(), full_matrices=False)
    top = s[..., :1]
    keep = (s > EPS * top) & (top > 0)
    polar = (u * keep.unsqueeze(-2)) @ vh
    norm = polar.norm(dim=(-2, -1), keepdim=True)
    scaled = torch.where(norm > 0, polar * (math.sqrt(rank) / norm.clamp_min(torch.finfo(norm.dtype).tiny)), 0.0)
    return scaled.to(momentum.dtype)


class Dimuon(torch.optim.Optimizer):
    """The per-run optimizer state (one momentum per LoRA matrix) and step; saved and loaded like AdamW's."""

    def __init__(self, params, rank: int) -> None:
        super().__init__(params, {"lr": 1e-4, "beta1": 0.9, "rank": rank})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(param)
                momentum = state["momentum"]
                momentum.mul_(group["beta1"]).add_(param.grad, alpha=1 - group["beta1"])
                param.add_(direction(momentum, group["rank"]), alpha=-group["lr"])
