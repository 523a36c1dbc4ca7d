"""The trainer's chosen-token log-probabilities (``adapters.trainer.logprobs``) against float64 autograd through
``log_softmax``, and the CPU allocator setting that keeps a pass's freed memory (``adapters.cpu_memory``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from adapters.trainer.logprobs import target_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
    exact = logits.detach().double().requires_grad_()
    values = torch.log_softmax(exact, dim=-1).gather(1, targets)
    (values * weights.double()).sum().backward()
    return values, exact.grad


@pytest.mark.parametrize("k", [1, 3])
def test_values_and_gradients_match_float64_log_softmax(k: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g) * 8
    logits[0, :10] += 60  # a row whose mass sits on a few tokens: its other tokens' logprobs near -70
    logits[1, 5] = float("-inf")  # a masked token, not a target
    targets = torch.randint(0, 1000, (64, k), generator=g)
    targets[0, 0] = 500  # a target of probability ~e-70
    targets[1, 0] = 6
    weights = torch.randn(64, k, generator=g)
    mine = logits.clone().requires_grad_()
    values = target_logprobs(mine, targets)
    (values * weights).sum().backward()
    expected_values, expected_grad = _reference(logits, targets, weights)
    assert values.dtype == torch.float32 and values.shape == (64, k)
    assert float(expected_values[0, 0]) < -60
    torch.testing.assert_close(values.double(), expected_values, rtol=1e-6, atol=1e-5)
    assert torch.equal(values.detach(), torch.log_softmax(logits, dim=-1).gather(1, targets))  # the samplers' values
    torch.testing.assert_close(mine.grad.double(), expected_grad, rtol=1e-5, atol=1e-6)
    assert float(mine.grad[1, 5]) == 0.0


def test_a_repeated_target_gets_each_of_its_gradients() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([[3, 3], [7, 1], [0, 0], [49, 2]])
    weights = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0], [1.0, 1.0]])
    mine = logits.clone().requires_grad_()
    (target_logprobs(mine, targets) * weights).sum().backward()
    torch.testing.assert_close(mine.grad.double(), _reference(logits, targets, weights)[1], rtol=1e-6, atol=1e-7)


def test_keeping_freed_memory_counts_it_as_available() -> None:
    """After ``keep_freed`` a freed 1 GiB tensor stays in the process, and what a pass may count on
    (``available_bytes``) grows by it as when the memory goes back to the system (other processes' use of the
    machine's memory moves the figure a little: 3/4 of it is asked); run in a child so this test process's allocator
    is left as it was."""
    code = textwrap.dedent("""
        import torch
        from adapters.cpu_memory import heap_free_bytes, keep_freed
        from adapters.trainer.memory import available_bytes
        assert keep_freed()
        before = heap_free_bytes()
        held = torch.ones(256, 2**20)  # 1 GiB
        during = available_bytes(torch.device("cpu"))
        del held
        kept = heap_free_bytes() - before
        after = available_bytes(torch.device("cpu"))
        print(kept, during, after)
        assert kept >= 0.99 * 2**30, kept  # less what the readings themselves took from the free heap
        assert after >= during + 0.75 * 2**30, (during, after)
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
