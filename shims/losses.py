"""The loss functions, one table: each loss's inputs, config defaults and formula, as pure torch functions.

Every loss receives, per datum, the learner's log-probabilities of the target tokens (``target_logprobs``, shape
``(N,)`` or ``(N, K)``) with gradient attached, plus that datum's ``loss_fn_inputs`` as tensors. As Tinker documents,
every built-in loss is a plain sum of per-token terms over positions and datums — no mean — and reports it as the
metric ``loss:sum``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from shims.errors import UserError

Config = Mapping[str, float | str]


@dataclass(frozen=True)
class LossSpec:
    """One row of the loss table."""

    name: str
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], Config], torch.Tensor]
    """(target_logprobs, inputs, config) → summed scalar loss of one datum."""
    required_inputs: tuple[str, ...]
    int_inputs: tuple[str, ...] = ("target_tokens",)
    config_defaults: dict[str, float | str] = field(default_factory=dict)
    server_inputs: tuple[str, ...] = ()
    """Inputs the server attaches itself (from what it recorded at sampling time); a client may not send them."""
    optional_inputs: tuple[str, ...] = ()
    """Inputs a client may leave out; the loss function supplies their default."""


def _cross_entropy(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """``-(logprobs * weights).sum()`` — weights may be any float, the SDK's custom-loss path sends ``-grad`` here."""
    return -(target_logprobs * inputs["weights"]).sum()


def _ratio(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """p_θ / q per token: the learner's probability over the sampler's, from their logprobs."""
    return torch.exp(target_logprobs - inputs["logprobs"])


def _importance_sampling(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """``-(r · A).sum()`` with ``r = exp(logprobs_learner − logprobs_sampler)``, unclipped (Tinker's definition)."""
    return -(_ratio(target_logprobs, inputs) * inputs["advantages"]).sum()


def _ppo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """``-min(r·A, clamp(r, lo, hi)·A).sum()`` per token. ``clip_low_threshold`` / ``clip_high_threshold`` are
    absolute ratio bounds (defaults 0.8 / 1.2, as Tinker's docs give), not ε."""
    ratio, advantages = _ratio(target_logprobs, inputs), inputs["advantages"]
    clipped = torch.clamp(ratio, float(config["clip_low_threshold"]), float(config["clip_high_threshold"]))
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def _cispo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """``-(sg(clamp(r, lo, hi)) · logprobs_learner · A).sum()``: the clipped ratio only weights the policy gradient
    (no gradient through it). Defaults 0.0 / 4.0 — the one-sided clip Tinker's docs give."""
    weight = torch.clamp(_ratio(target_logprobs, inputs), float(config["clip_low_threshold"]),
                         float(config["clip_high_threshold"])).detach()
    return -(weight * target_logprobs * inputs["advantages"]).sum()


def _dro(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """``-(logprobs_learner · A − ½ β (logprobs_learner − logprobs_sampler)²).sum()``. Tinker's docs show β only as an
    example (0.05) and state no default; 0.05 is used as the default, as other Tinker-compatible servers do."""
    beta = float(config["beta"])
    drift = target_logprobs - inputs["logprobs"]
    return -(target_logprobs * inputs["advantages"] - 0.5 * beta * drift**2).sum()


def _sequence_ratio_positions(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The positions gspo's sequence ratio averages over: ``sequence_ratio_mask != 0`` when the client sends it.

    The SDK declares ``sequence_ratio_mask`` optional (``tinker/types/datum.py`` types it but no client code requires
    it), and tinker-cookbook 0.6.1's common RL path (``tinker_cookbook.rl.train`` via ``rl/data_processing.py``)
    never sends it: its data carry ``logprobs = 0`` and ``advantages = 0`` on every observation (prompt) position and
    the sampler's logprob and the trajectory's advantage on each sampled token. Tinker's docs state no default in
    what could be read, so the default is the positions that carry an RL signal, ``logprobs != 0 or advantages !=
    0``: on the cookbook's data this is exactly the mask its ``recipes/rl_loop.py`` sends explicitly (0 on the
    prompt, 1 on sampled tokens). A datum with no such position has all advantages zero, so its loss is 0.
    """
    if "sequence_ratio_mask" in inputs:
        return inputs["sequence_ratio_mask"] != 0
    return (inputs["logprobs"] != 0) | (inputs["advantages"] != 0)


def _gspo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """GSPO-token, as Tinker documents it: every token carries the value of the sequence ratio
    ``s = exp(mean over sequence_ratio_mask of (logprobs_learner − logprobs_sampler))`` with the gradient of its own
    log-probability, then the PPO objective ``-min(s_t·A, clamp(s_t, lo, hi)·A).sum()``.

    The bounds are absolute ratio bounds, like ppo's. Tinker's page gives them as ``1 − ε_low`` / ``1 + ε_high`` but
    no default survives in what could be read; the defaults here are the GSPO paper's ε = 3e-4 / 4e-4 (0.9997 /
    1.0004), because a sequence-level (geometric-mean) ratio moves far less than a token ratio and PPO's 0.8 / 1.2
    would never clip it.
    """
    in_ratio = _sequence_ratio_positions(inputs)
    log_ratio = (target_logprobs.detach() - inputs["logprobs"])[in_ratio].mean() if in_ratio.any() \
        else target_logprobs.new_zeros(())
    ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())
    advantages = inputs["advantages"]
    clipped = torch.clamp(ratio, float(config["clip_low_threshold"]), float(config["clip_high_threshold"]))
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def _stable_reinforce(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """A documented stand-in: Tinker's StableReinforce objective is not public (its page describes only the
    protocol). This is truncated-importance-weighted REINFORCE against what the sampler recorded:

    ``q_t`` = the sampler's logprob recorded at sampling time for tokens the provenance spans name as sampled
    (``recorded_mask``), the client's ``logprobs`` elsewhere; ``w_t = sg(min(exp(logprobs_learner − q_t),
    clip_high_threshold))``; ``loss = -(w · logprobs_learner · A).sum() + kl_coeff · Σ_sampled ½(logprobs_learner −
    q)²``. The stop-gradient weight keeps every token's gradient bounded however far the policies drift (the
    instability plain importance sampling suffers), and the recorded logprobs are the sampler's own numbers, not a
    copy the client may have altered. Defaults: ``clip_high_threshold`` 2.0, ``kl_coeff`` 0.0.
    """
    recorded = inputs["recorded_mask"] != 0
    sampler_logprobs = torch.where(recorded, inputs["recorded_logprobs"], inputs["logprobs"])
    drift = target_logprobs - sampler_logprobs
    weight = torch.clamp(torch.exp(drift), max=float(config["clip_high_threshold"])).detach()
    penalty = 0.5 * float(config["kl_coeff"]) * (drift[recorded] ** 2).sum()
    return -(weight * target_logprobs * inputs["advantages"]).sum() + penalty


RL_INPUTS = ("target_tokens", "logprobs", "advantages")
CLIP = ("clip_low_threshold", "clip_high_threshold")

LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in [
        LossSpec("cross_entropy", _cross_entropy, required_inputs=("target_tokens", "weights")),
        LossSpec("importance_sampling", _importance_sampling, required_inputs=RL_INPUTS),
        LossSpec("ppo", _ppo, required_inputs=RL_INPUTS, config_defaults=dict(zip(CLIP, (0.8, 1.2)))),
        LossSpec("cispo", _cispo, required_inputs=RL_INPUTS, config_defaults=dict(zip(CLIP, (0.0, 4.0)))),
        LossSpec("dro", _dro, required_inputs=RL_INPUTS, config_defaults={"beta": 0.05}),
        LossSpec("gspo", _gspo, required_inputs=RL_INPUTS, optional_inputs=("sequence_ratio_mask",),
                 config_defaults=dict(zip(CLIP, (1 - 3e-4, 1 + 4e-4)))),
        LossSpec("stable_reinforce", _stable_reinforce, required_inputs=RL_INPUTS,
                 config_defaults={"clip_high_threshold": 2.0, "kl_coeff": 0.0},
                 server_inputs=("recorded_logprobs", "recorded_mask")),
    ]
}


def resolve_config(loss_fn: str, config: Config) -> dict[str, float | str]:
    """The loss's config with defaults filled in; an unknown loss or config key is a user error, never ignored."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise UserError(f"unknown loss_fn {loss_fn!r}; this server supports: {', '.join(sorted(LOSSES))}")
    unknown = sorted(set(config) - set(spec.config_defaults))
    if unknown:
        allowed = ", ".join(sorted(spec.config_defaults)) or "none"
        raise UserError(f"loss_fn_config keys {unknown} are not used by {loss_fn!r} (accepted keys: {allowed})")
    resolved = {**spec.config_defaults, **config}
    for key, value in resolved.items():
        if isinstance(spec.config_defaults[key], float) and (
                isinstance(value, str) or not np.isfinite(value)):
            raise UserError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    if "clip_low_threshold" in resolved and not \
            0 <= resolved["clip_low_threshold"] <= resolved["clip_high_threshold"]:
        raise UserError("loss_fn_config needs 0 ≤ clip_low_threshold ≤ clip_high_threshold, got "
                        f"{resolved['clip_low_threshold']} and {resolved['clip_high_threshold']}")
    for key in ("clip_high_threshold", "beta", "kl_coeff"):
        if key in resolved and resolved[key] < 0:
            raise UserError(f"loss_fn_config[{key!r}] must not be negative, got {resolved[key]}")
    return resolved


def check_datum(loss_fn: str, index: int, tokens: np.ndarray, inputs: Mapping[str, np.ndarray], *,
                vocab_size: int, max_context: int) -> None:
    """Reject what the model cannot compute, naming the datum and the field: lengths, token ranges, shapes, NaN."""
    spec = LOSSES[loss_fn]
    n = tokens.size
    where = f"datum {index}"
    if n == 0:
        raise UserError(f"{where}: model_input is empty")
    if n > max_context:
        raise UserError(f"{where}: {n} input tokens exceed the model's maximum context length of {max_context}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise UserError(f"{where}: model_input token ids must lie in [0, {vocab_size}), got {tokens.min()}..{tokens.max()}")
    missing = [name for name in spec.required_inputs + spec.server_inputs if name not in inputs]
    if missing:
        raise UserError(f"{where}: loss {loss_fn!r} needs loss_fn_inputs {missing}; got {sorted(inputs)}")
    extra = sorted(set(inputs) - set(spec.required_inputs) - set(spec.server_inputs) - set(spec.optional_inputs))
    if extra:
        raise UserError(f"{where}: loss {loss_fn!r} does not use loss_fn_inputs {extra}")
    target_shape = inputs["target_tokens"].shape
    if target_shape[:1] != (n,) or len(target_shape) > 2:
        raise UserError(f"{where}: target_tokens has shape {list(target_shape)}; expected [{n}] or [{n}, K] "
                        f"(one row per model_input position)")
    for name, array in inputs.items():
        if array.shape != target_shape:
            raise UserError(f"{where}: {name} has shape {list(array.shape)} but target_tokens has {list(target_shape)}")
        if name in spec.int_inputs:
            if array.dtype.kind != "i":
                raise UserError(f"{where}: {name} must be int64, got {array.dtype}")
            if array.size and (array.min() < 0 or array.max() >= vocab_size):
                raise UserError(f"{where}: {name} ids must lie in [0, {vocab_size}), got {array.min()}..{array.max()}")
        elif array.dtype != np.float32:
            raise UserError(f"{where}: {name} must be float32, got {array.dtype}")
        elif not np.all(np.isfinite(array)):
            raise UserError(f"{where}: {name} contains NaN or infinite values")
    if "sequence_ratio_mask" in inputs and not np.any(inputs["sequence_ratio_mask"]):
        raise UserError(f"{where}: sequence_ratio_mask marks no token, so the sequence ratio is undefined; mark the "
                        "sampled tokens with 1")


def datum_loss(loss_fn: str, target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: Config) -> torch.Tensor:
    """The summed loss of one datum under ``loss_fn`` (already validated by ``check_datum``)."""
    return LOSSES[loss_fn].fn(target_logprobs, inputs, config)
