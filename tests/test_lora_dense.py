"""The dense path of a LoRA layer (``LoRALinear._plus_dense``: a sampler's mixed batch, every adapter at once)
against each row computed on its own in plain torch, ``y = x·Wᵀ + scale·(x·Aᵀ)·Bᵀ``: adapters of different ranks and
scales, base rows, an adapter this layer does not carry, 3-D and flattened inputs, rows leaving the batch; the kept
side-by-side weights follow in-place updates and replaced adapters; gradients, adapters that train (an optimizer may
change them without a version bump), long calls and too-wide ranks take the per-group path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adapters.lora.linear import LoRALinear, Slot
from adapters.lora.routing import Router

IN, OUT = 256, 192


def layer() -> LoRALinear:
    torch.manual_seed(0)
    linear = LoRALinear(nn.Linear(IN, OUT, bias=True), Router(), [Slot("w", "attn", IN, OUT)], [(0, OUT)])
    for name, rank, scale in (("a", 2, 0.5), ("b", 8, 2.0), ("c", 4, 1.0)):
        linear.lora.put(name, [pair(rank)], scale, torch.device("cpu"), trainable=False)
    return linear


def pair(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B scaled so that a row's output stays of order 1, where float32 sums agree to 1e-5."""
    return torch.randn(rank, IN) / IN**0.5, torch.randn(OUT, rank) / rank**0.5


def reference(linear: LoRALinear, x: torch.Tensor, names: list[str | None]) -> torch.Tensor:
    rows = []
    for row, name in zip(x, names, strict=True):
        y = row @ linear.base.weight.T + linear.base.bias
        if name in linear.lora:
            (a, b), = linear.lora.pairs[name]
            y = y + linear.lora.scaling[name] * (row @ a.T) @ b.T
        rows.append(y)
    return torch.stack(rows)


NAMES = ["a", "a", None, "b", "c", "c", "missing", "b"]


def run(linear: LoRALinear, x: torch.Tensor, names: list[str | None]) -> torch.Tensor:
    with linear.router.routing(names):
        return linear(x)


@pytest.mark.parametrize("shape", [(len(NAMES), 5, IN), (len(NAMES), IN)], ids=["rows x tokens", "one token"])
def test_a_mixed_batch_without_gradients_equals_each_row_alone(shape):
    linear = layer()
    x = torch.randn(shape)
    with torch.no_grad():
        got = run(linear, x, NAMES)
        assert linear._dense_cache.entry is not None  # the dense path was taken
        torch.testing.assert_close(got, reference(linear, x, NAMES), atol=1e-5, rtol=1e-5)


def test_flattened_tokens_of_each_row_take_the_row_adapter():
    """A MoE block's shared expert sees the batch flattened row by row: each row's tokens keep its adapter."""
    linear = layer()
    x = torch.randn(len(NAMES), 3, IN)
    with torch.no_grad():
        got = run(linear, x.reshape(-1, IN), NAMES).reshape(len(NAMES), 3, OUT)
    torch.testing.assert_close(got, reference(linear, x, NAMES), atol=1e-5, rtol=1e-5)


def test_kept_weights_follow_updates_and_replaced_adapters():
    linear = layer()
    x = torch.randn(len(NAMES), 2, IN)
    with torch.no_grad():
        run(linear, x, NAMES)
        linear.lora.pairs["b"][0][1].add_(1.0)  # an optimizer step, in place
        torch.testing.assert_close(run(linear, x, NAMES), reference(linear, x, NAMES), atol=1e-5, rtol=1e-5)
        linear.lora.put("c", [pair(3)], 4.0, torch.device("cpu"), False)
        torch.testing.assert_close(run(linear, x, NAMES), reference(linear, x, NAMES), atol=1e-5, rtol=1e-5)


def test_rows_leaving_the_batch_keep_the_weights_and_regroup():
    linear = layer()
    x = torch.randn(len(NAMES), 2, IN)
    with torch.no_grad():
        run(linear, x, NAMES)
        kept = linear._dense_cache.entry
        fewer = [0, 2, 3, 4, 6, 7]  # a row of "a" and one of "c" finished: the same groups, other rows
        names = [NAMES[i] for i in fewer]
        got = run(linear, x[fewer], names)
        assert linear._dense_cache.entry is kept
    torch.testing.assert_close(got, reference(linear, x[fewer], names), atol=1e-5, rtol=1e-5)


def per_group(linear: LoRALinear, x: torch.Tensor, atol: float = 1e-5) -> None:
    """``linear`` takes the per-group path for ``x`` (nothing kept side by side), and computes it right."""
    got = run(linear, x, NAMES)
    assert linear._dense_cache.entry is None
    torch.testing.assert_close(got, reference(linear, x, NAMES), atol=atol, rtol=1e-5)


def test_adapters_that_train_take_the_per_group_path_even_without_gradients():
    """A trainer's forward-only pass: its adapters may have been stepped in place by a fused optimizer since, which
    torch's version counter does not see, so nothing of them is kept."""
    linear = layer()
    for pair in linear.lora.pairs.values():
        for tensor in pair[0]:
            tensor.requires_grad_(True)
    with torch.no_grad():
        per_group(linear, torch.randn(len(NAMES), 2, IN))


def test_a_long_call_takes_the_per_group_path():
    with torch.no_grad():
        per_group(layer(), torch.randn(len(NAMES), LoRALinear.DENSE_MAX_TOKENS // len(NAMES) + 1, IN), atol=1e-4)


def test_with_gradients_the_per_group_path_runs_and_agrees():
    per_group(layer(), torch.randn(len(NAMES), 2, IN, requires_grad=True))


def test_ranks_too_wide_side_by_side_take_the_per_group_path():
    linear = layer()
    linear.lora.put("b", [pair(16)], 1.0, torch.device("cpu"), False)
    with torch.no_grad():
        per_group(linear, torch.randn(len(NAMES), 2, IN))  # 6 groups × rank 16 × 4 > 192


def test_an_adapter_with_non_finite_weights_reaches_only_its_own_rows():
    """Side by side, every row would meet its NaN (0 · NaN is NaN): it takes the per-group path, and the other
    adapters' rows are exact."""
    linear = layer()
    linear.lora.pairs["c"][0][1][0, 0] = float("nan")
    x = torch.randn(len(NAMES), 2, IN)
    with torch.no_grad():
        got = run(linear, x, NAMES)
    assert linear._dense_cache.entry is None
    others = [i for i, name in enumerate(NAMES) if name != "c"]
    torch.testing.assert_close(got[others], reference(linear, x, NAMES)[others], atol=1e-5, rtol=1e-5)
    assert torch.isnan(got[[i for i, name in enumerate(NAMES) if name == "c"]]).any()


def test_an_adapter_that_overflows_on_other_rows_leaves_them_exact():
    """Finite weights so large that x·Aᵀ overflows: on the rows of other adapters that block is dropped, not
    multiplied by 0 (which would make it NaN)."""
    linear = layer()
    linear.lora.pairs["a"][0][0].fill_(3e38)
    x = torch.randn(len(NAMES), 2, IN)
    with torch.no_grad():
        got = run(linear, x, NAMES)
        assert linear._dense_cache.entry is not None
    others = [i for i, name in enumerate(NAMES) if name != "a"]
    torch.testing.assert_close(got[others], reference(linear, x, NAMES)[others], atol=1e-5, rtol=1e-5)
