"""The loss table, checked against independent numpy / analytic references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config
from tests.helpers import reference_gspo, reference_rl, reference_stable_reinforce


@pytest.mark.parametrize("shape", [(7,), (5, 3)])
def test_cross_entropy_value_and_gradient(shape):
    rng = np.random.default_rng(3)
    logprobs = -rng.exponential(size=shape)
    weights = rng.normal(size=shape).astype(np.float32)
    weights.flat[0] = 0.0  # a masked token
    lp = torch.tensor(logprobs, requires_grad=True)
    loss = datum_loss("cross_entropy", lp, {"weights": torch.tensor(weights)}, resolve_config("cross_entropy", {}))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-np.sum(logprobs * weights), rel=1e-6)
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


@pytest.mark.parametrize(("config", "drift"), [
    ({}, 0.0), ({}, 0.3), ({}, -0.3),  # default bounds: s ≈ 1 unclipped, or far outside and clipped
    ({"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, 0.3),
    ({"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, -1.2),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_value_and_gradient_match_reference(config, drift, seed):
    rng = np.random.default_rng(seed)
    n = 30
    sampler = -rng.exponential(size=n)
    learner = sampler + drift + rng.normal(scale=0.05, size=n)
    advantages = rng.normal(size=n)
    advantages[:5] = 0.0  # prompt positions
    mask = np.ones(n)
    mask[:5] = 0.0  # …which do not enter the sequence ratio
    resolved = resolve_config("gspo", config)
    lp = torch.tensor(learner, requires_grad=True)
    loss = datum_loss("gspo", lp, {"logprobs": torch.tensor(sampler), "advantages": torch.tensor(advantages),
                                   "sequence_ratio_mask": torch.tensor(mask)}, resolved)
    loss.backward()
    value, grad = reference_gspo(learner, sampler, advantages, mask, resolved["clip_low_threshold"],
                                 resolved["clip_high_threshold"])
    assert float(loss.detach()) == pytest.approx(value, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-9, atol=1e-12)
    # One ratio for the whole sequence: above the bound every positive-advantage token is clipped, below it every
    # negative one; inside, every token with an advantage moves.
    s = np.exp(np.mean((learner - sampler)[5:]))
    lo, hi = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
    frozen = advantages > 0 if s > hi else advantages < 0 if s < lo else advantages == 0
    np.testing.assert_array_equal(lp.grad.numpy() == 0, frozen | (advantages == 0))


def test_gspo_ratio_uses_only_masked_tokens():
    learner = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    inputs = {"logprobs": torch.tensor([-1.0, -5.0, -3.0]), "advantages": torch.tensor([1.0, 1.0, 1.0]),
              "sequence_ratio_mask": torch.tensor([1.0, 0.0, 1.0])}
    loss = datum_loss("gspo", learner, inputs, resolve_config("gspo", {}))
    # masked tokens have ratio 1 exactly, so the unmasked token's drift (e^3) never enters s
    assert float(loss.detach()) == pytest.approx(-3.0)
    with pytest.raises(UserError, match="sequence_ratio_mask marks no token"):
        check_datum("gspo", 0, np.arange(3), {"target_tokens": np.arange(3), "logprobs": np.zeros(3, np.float32),
                                              "advantages": np.zeros(3, np.float32),
                                              "sequence_ratio_mask": np.zeros(3, np.float32)},
                    vocab_size=50, max_context=10)


def test_gspo_without_a_mask_takes_the_ratio_over_the_positions_that_carry_a_signal():
    """The cookbook's rl.train path sends no sequence_ratio_mask: its prompt positions carry logprobs 0 and
    advantages 0. Leaving the mask out must equal sending rl_loop's explicit mask (0 on the prompt, 1 on samples)."""
    rng = np.random.default_rng(3)
    n, prompt = 12, 4
    sampler = -rng.exponential(size=n)
    advantages = np.full(n, 0.7)
    sampler[:prompt], advantages[:prompt] = 0.0, 0.0
    learner = -rng.exponential(size=n)  # the learner's prompt logprobs are far from 0: they must not enter s
    mask = (np.arange(n) >= prompt).astype(np.float64)
    resolved = resolve_config("gspo", {"clip_low_threshold": 0.2, "clip_high_threshold": 5.0})
    grads, losses = [], []
    for extra in ({}, {"sequence_ratio_mask": torch.tensor(mask)}):
        lp = torch.tensor(learner, requires_grad=True)
        loss = datum_loss("gspo", lp, {"logprobs": torch.tensor(sampler), "advantages": torch.tensor(advantages),
                                       **extra}, resolved)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(lp.grad.numpy())
    value, grad = reference_gspo(learner, sampler, advantages, mask, 0.2, 5.0)
    assert losses[0] == pytest.approx(value, rel=1e-9) and losses[1] == pytest.approx(value, rel=1e-9)
    np.testing.assert_allclose(grads[0], grad, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(grads[1], grad, rtol=1e-9, atol=1e-12)
    check_datum("gspo", 0, np.arange(n), {"target_tokens": np.arange(n), "logprobs": sampler.astype(np.float32),
                                          "advantages": advantages.astype(np.float32)}, vocab_size=50, max_context=20)
    # A datum with no signal at all (every advantage 0) has loss 0 and a zero gradient, not NaN.
    lp = torch.tensor(learner, requires_grad=True)
    empty = datum_loss("gspo", lp, {"logprobs": torch.zeros(n, dtype=torch.float64),
                                    "advantages": torch.zeros(n, dtype=torch.float64)}, resolved)
    empty.backward()
    assert float(empty.detach()) == 0.0 and not lp.grad.any()


@pytest.mark.parametrize("config", [{}, {"kl_coeff": 0.2}, {"clip_high_threshold": 1.1, "kl_coeff": 0.05}])
@pytest.mark.parametrize("seed", [0, 1])
def test_stable_reinforce_value_and_gradient_match_reference(config, seed):
    learner, client_lp, advantages = rl_case(seed)
    rng = np.random.default_rng(seed + 10)
    recorded_mask = (rng.uniform(size=learner.size) > 0.2).astype(np.float64)
    recorded = client_lp + rng.normal(scale=0.3, size=learner.size)  # the recorded numbers differ from the client's
    resolved = resolve_config("stable_reinforce", config)
    lp = torch.tensor(learner, requires_grad=True)
    loss = datum_loss("stable_reinforce", lp, {
        "logprobs": torch.tensor(client_lp), "advantages": torch.tensor(advantages),
        "recorded_logprobs": torch.tensor(recorded), "recorded_mask": torch.tensor(recorded_mask)}, resolved)
    loss.backward()
    value, grad = reference_stable_reinforce(learner, client_lp, advantages, recorded, recorded_mask,
                                             resolved["clip_high_threshold"], resolved["kl_coeff"])
    assert float(loss.detach()) == pytest.approx(value, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-9, atol=1e-12)
    assert np.abs(lp.grad.numpy()).max() <= resolved["clip_high_threshold"] * np.abs(advantages).max() + \
        resolved["kl_coeff"] * np.abs(learner - recorded).max() + 1e-12  # bounded however far the policies drift


def test_gspo_and_stable_reinforce_defaults_and_server_inputs():
    assert resolve_config("gspo", {}) == pytest.approx({"clip_low_threshold": 0.9997, "clip_high_threshold": 1.0004})
    assert resolve_config("stable_reinforce", {}) == {"clip_high_threshold": 2.0, "kl_coeff": 0.0}
    with pytest.raises(UserError, match="must not be negative"):
        resolve_config("stable_reinforce", {"kl_coeff": -1.0})
    inputs = {"target_tokens": np.arange(4), "logprobs": np.zeros(4, np.float32), "advantages": np.ones(4, np.float32)}
    with pytest.raises(UserError, match=r"needs loss_fn_inputs \['recorded_logprobs', 'recorded_mask'\]"):
        check_datum("stable_reinforce", 0, np.arange(4), inputs, vocab_size=50, max_context=10)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_take_several_targets_per_position(loss_fn):
    """``(N, K)`` inputs (K candidate targets per position) are elementwise: the same as flattening them."""
    learner, sampler, advantages = (a.reshape(8, 5) for a in rl_case(2))
    resolved = resolve_config(loss_fn, {})
    lp = torch.tensor(learner, requires_grad=True)
    loss = datum_loss(loss_fn, lp, {"logprobs": torch.tensor(sampler), "advantages": torch.tensor(advantages)},
                      resolved)
    loss.backward()
    value, grad = reference_rl(loss_fn, learner.ravel(), sampler.ravel(), advantages.ravel(), resolved)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-9)
    np.testing.assert_allclose(lp.grad.numpy().ravel(), grad, rtol=1e-9, atol=1e-12)
    check_datum(loss_fn, 0, np.arange(8), {"target_tokens": np.zeros((8, 5), np.int64),
                                           "logprobs": sampler.astype(np.float32),
                                           "advantages": advantages.astype(np.float32)},
                vocab_size=50, max_context=10)
