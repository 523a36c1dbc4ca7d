"""The loss table, checked against independent numpy / analytic references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config
from tests.helpers import reference_rl


@pytest.mark.parametrize("shape", [(7,), (5, 3)])
def test_cross_entropy_value_and_gradient(shape):
    rng = np.random.default_rng(3)
    logprobs = -rng.exponential(size=shape)
    weights = rng.normal(size=shape).astype(np.float32)
    weights.flat[0] = 0.0  # a masked token
    lp = torch.tensor(logprobs, requires_grad=True)
    loss = datum_loss("cross_entropy", lp, {"weights": torch.tensor(weights)}, resolve_config("cross_entropy", {}))
    loss.backward()
    assert float(loss) == pytest.approx(-np.sum(logprobs * weights), rel=1e-6)
    np.testing.assert_allclose(lp.grad.numpy(), -weights, rtol=1e-6)  # d/dlp of -sum(lp*w) is -w


def test_config_is_checked_never_ignored():
    with pytest.raises(UserError, match="unknown loss_fn 'nope'.*cross_entropy"):
        resolve_config("nope", {})
    with pytest.raises(UserError, match=r"loss_fn_config keys \['temperature'\]"):
        resolve_config("cross_entropy", {"temperature": 1.0})


def good_inputs(n=4):
    return {"target_tokens": np.arange(n, dtype=np.int64), "weights": np.ones(n, dtype=np.float32)}


@pytest.mark.parametrize("tokens, inputs, message", [
    (np.array([], dtype=np.int64), good_inputs(0), "empty"),
    (np.arange(11, dtype=np.int64), good_inputs(11), "maximum context length of 10"),
    (np.array([1, 2, 3, 99], dtype=np.int64), good_inputs(), r"token ids must lie in \[0, 50\)"),
    (np.arange(4, dtype=np.int64), {"target_tokens": np.arange(4, dtype=np.int64)}, r"needs loss_fn_inputs \['weights'\]"),
    (np.arange(4, dtype=np.int64), {**good_inputs(), "advantages": np.ones(4, np.float32)}, "does not use"),
    (np.arange(4, dtype=np.int64), {**good_inputs(), "weights": np.ones(3, np.float32)}, "weights has shape"),
    (np.arange(4, dtype=np.int64), {**good_inputs(), "target_tokens": np.arange(3, dtype=np.int64)},
     "one row per model_input position"),
    (np.arange(4, dtype=np.int64), {**good_inputs(), "target_tokens": np.array([0, 1, 2, 50])}, "target_tokens ids"),
    (np.arange(4, dtype=np.int64), {**good_inputs(), "target_tokens": np.ones(4, np.float32)}, "must be int64"),
    (np.arange(4, dtype=np.int64), {**good_inputs(), "weights": np.array([1, np.inf, 0, 0], np.float32)}, "NaN or inf"),
])
def test_check_datum_names_the_problem(tokens, inputs, message):
    with pytest.raises(UserError, match=message):
        check_datum("cross_entropy", 2, tokens, inputs, vocab_size=50, max_context=10)


def test_check_datum_accepts_good_input():
    check_datum("cross_entropy", 0, np.arange(4, dtype=np.int64), good_inputs(), vocab_size=50, max_context=10)


def rl_case(seed: int, n: int = 40):
    """Learner and sampler logprobs whose ratios fall inside and outside every clip range used below, advantages of
    both signs, and some masked (zero-advantage) tokens."""
    rng = np.random.default_rng(seed)
    sampler = -rng.exponential(size=n)
    learner = sampler + rng.uniform(-1.5, 1.5, size=n)
    advantages = rng.normal(size=n)
    advantages[::7] = 0.0
    return learner, sampler, advantages


@pytest.mark.parametrize(("loss_fn", "config"), [
    ("importance_sampling", {}), ("ppo", {}), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {}), ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}), ("dro", {}),
    ("dro", {"beta": 0.3}),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_rl_losses_value_and_gradient_match_reference(loss_fn, config, seed):
    learner, sampler, advantages = rl_case(seed)
    resolved = resolve_config(loss_fn, config)
    lp = torch.tensor(learner, requires_grad=True)
    loss = datum_loss(loss_fn, lp, {"logprobs": torch.tensor(sampler), "advantages": torch.tensor(advantages)},
                      resolved)
    loss.backward()
    value, grad = reference_rl(loss_fn, learner, sampler, advantages, resolved)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-9, atol=1e-12)
    assert np.all(lp.grad.numpy()[::7] == 0) or loss_fn == "dro"  # masked tokens move nothing (DRO's KL term does)


def test_rl_loss_defaults_and_config_checks():
    assert resolve_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_config("dro", {}) == {"beta": 0.05}
    assert resolve_config("importance_sampling", {}) == {}
    with pytest.raises(UserError, match="clip_low_threshold ≤ clip_high_threshold"):
        resolve_config("ppo", {"clip_low_threshold": 1.3})
    with pytest.raises(UserError, match="must be a finite number"):
        resolve_config("dro", {"beta": "high"})
    with pytest.raises(UserError, match="must be a finite number"):
        resolve_config("ppo", {"clip_high_threshold": float("nan")})
    with pytest.raises(UserError, match=r"needs loss_fn_inputs \['logprobs', 'advantages'\]"):
        check_datum("ppo", 0, np.arange(4, dtype=np.int64), good_inputs(), vocab_size=50, max_context=10)
