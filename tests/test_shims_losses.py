"""The loss table, checked against independent numpy / analytic references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shims.errors import UserError
from shims.losses import check_datum, datum_loss, resolve_config


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
