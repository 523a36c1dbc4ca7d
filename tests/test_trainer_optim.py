"""Optimizer steps of several runs in one trainer call: each run ends exactly where its own step would leave it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from adapters.trainer.actor import AdamHyper, LoraSpec, MultiLoRATrainer
from adapters.trainer.interface import DimuonHyper, OptimRequest, StepRequest
from adapters.trainer.optim import adamw_together
from shims.errors import UserError
from shims.tinker.training_wire import DatumArrays


def _params(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def _with_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def test_adamw_together_equals_each_optimizer_s_own_step_bit_for_bit():
    """Three optimizers with different shapes, weight decay, and step counts (one has stepped twice already)."""
    shapes = [[(4, 8), (8, 4)], [(3, 5), (5, 3), (7,)], [(16, 2)]]
    hyper = AdamHyper(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1)
    runs = []
    for _copy in range(2):
        params = [_params(i, s) for i, s in enumerate(shapes)]
        optimizers = [torch.optim.AdamW(p, foreach=True) for p in params]
        runs.append((params, optimizers))
    for params, optimizers in runs:  # the third run is two steps ahead, in both copies
        for step in range(2):
            _with_grads(params[2], 100 + step)
            optimizers[2].step()
    for round_ in range(3):
        for copy, (params, optimizers) in enumerate(runs):
            for i, p in enumerate(params):
                _with_grads(p, 10 * round_ + i)
            if copy == 0:
                for optimizer in optimizers:
                    for group in optimizer.param_groups:
                        group.update(lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                                     weight_decay=hyper.weight_decay)
                    optimizer.step()
            else:
                adamw_together(optimizers, hyper)
    (own, own_optimizers), (together, together_optimizers) = runs
    for a, b in zip(itertools.chain(*own), itertools.chain(*together), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(own_optimizers, together_optimizers, strict=True):
        for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a.state[pa][key], b.state[pb][key])
    assert float(own_optimizers[2].state[own[2][0]]["step"]) == 5.0


def test_adamw_together_is_adamw():
    """An independent reference: torch's single-tensor (for-loop) AdamW, a different implementation."""
    hyper = AdamHyper(learning_rate=1e-2, weight_decay=0.05)
    ours, reference = _params(0, [(6, 3), (3,)]), _params(0, [(6, 3), (3,)])
    mine = torch.optim.AdamW(ours, foreach=True)
    theirs = torch.optim.AdamW(reference, lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                               weight_decay=hyper.weight_decay, foreach=False)
    for step in range(4):
        _with_grads(ours, step)
        _with_grads(reference, step)
        adamw_together([mine], hyper)
        theirs.step()
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, _params(0, [(6, 3), (3,)])[0 if a.dim() == 2 else 1])


TOKENS = np.arange(5, 14)
DATUM = DatumArrays(tokens=TOKENS[:-1], loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": np.ones(8, np.float32)})
RUNS = {  # model_id: (LoRA layout, optim_step parameters)
    "a": (LoraSpec(rank=4, seed=1), AdamHyper(learning_rate=1e-2, grad_clip_norm=0.05)),
    "b": (LoraSpec(rank=2, seed=2, train_mlp=False), AdamHyper(learning_rate=1e-2, grad_clip_norm=0.05)),
    "c": (LoraSpec(rank=4, seed=3), AdamHyper(learning_rate=3e-3, weight_decay=0.1)),
    "d": (LoraSpec(rank=4, seed=4, optimizer="dimuon"), DimuonHyper(learning_rate=1e-2)),
}


@pytest.fixture(scope="module")
def trainers(tiny_model_dir):
    made = []
    for _ in range(2):
        trainer = MultiLoRATrainer(str(tiny_model_dir))
        for model_id, (spec, _) in RUNS.items():
            trainer.create(model_id, spec)
        made.append(trainer)
    return made


def test_runs_stepping_in_one_call_end_where_their_own_steps_would(trainers):
    """Two AdamW runs with the same parameters (one AdamW call), one with others, a Dimuon run, and two refused
    requests (an unknown run; the wrong optimizer family for the Dimuon run, before or after its real step)."""
    alone, together = trainers
    for step in range(3):
        metrics_alone = {}
        for model_id, (_, hyper) in RUNS.items():
            alone.forward_backward(model_id, [DATUM], "cross_entropy", {}, False)
            metrics_alone[model_id] = alone.optim_step(model_id, hyper)
        forward_backward = [StepRequest(model_id, [DATUM], "cross_entropy", {}, False) for model_id in RUNS]
        if step == 0:
            together.run_batch(forward_backward)  # one mixed-adapter batch
        else:
            for request in forward_backward:
                together.run_batch([request])
        requests = [OptimRequest(model_id, hyper) for model_id, (_, hyper) in RUNS.items()]
        requests.insert(2, OptimRequest("unknown", AdamHyper()))
        requests.insert(4 if step == 0 else 5, OptimRequest("d", AdamHyper()))
        outcomes = together.run_batch(requests)
        refused = [str(o) for o in outcomes if isinstance(o, UserError)]
        assert len(refused) == 2 and "model unknown is not loaded on the trainer" in refused
        assert [o for o in outcomes if not isinstance(o, UserError)] == list(metrics_alone.values())
    for model_id in RUNS:
        for a, b in zip(alone.adapters[model_id].params, together.adapters[model_id].params, strict=True):
            assert torch.equal(a, b), model_id
        assert together.adapters[model_id].step == 3


def test_a_clipped_step_is_adamw_on_the_clipped_gradient(tiny_model_dir):
    """Independent reference: the gradient scaled to the clip norm by hand, then torch's single-tensor AdamW."""
    trainer = MultiLoRATrainer(str(tiny_model_dir))
    trainer.create("clip", LoraSpec(rank=4, seed=5))
    trainer.forward_backward("clip", [DATUM], "cross_entropy", {}, False)
    params = trainer.adapters["clip"].params
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]))
    for mine, theirs in zip(params, reference, strict=True):
        theirs.grad = None if mine.grad is None else mine.grad * (0.05 / (float(norm) + 1e-6))
    hyper = AdamHyper(learning_rate=1e-2, grad_clip_norm=0.05)
    metrics = trainer.optim_step("clip", hyper)
    torch.optim.AdamW(reference, lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                      weight_decay=hyper.weight_decay, foreach=False).step()
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5) and metrics["grad_norm"] > 0.5
    for mine, theirs in zip(params, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_a_run_steps_at_most_once_per_call(trainers):
    trainer = trainers[1]
    trainer.forward_backward("a", [DATUM], "cross_entropy", {}, False)
    first, second = trainer.optim_steps([OptimRequest("a", AdamHyper()), OptimRequest("a", AdamHyper())])
    assert isinstance(second, UserError) and "already steps" in str(second)
    assert first["step"] == trainer.adapters["a"].step


def test_a_routed_expert_pair_gets_a_dimuon_direction_per_expert():
    """A MoE LoRA pair is one matrix per expert, (experts, rows, columns): each expert's direction is its own
    momentum's polar factor at norm sqrt(rank), as a 2-D matrix's is; an expert with no momentum does not move (the
    per-expert SVD once failed on the 3-D tensor, for every MoE family)."""
    from adapters.trainer.dimuon import direction

    momentum = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0))
    momentum[1] = 0
    per_expert = direction(momentum, rank=4)
    for expert in range(3):
        torch.testing.assert_close(per_expert[expert], direction(momentum[expert], rank=4))
    assert float(per_expert[0].norm()) == pytest.approx(2.0, rel=1e-5) and not per_expert[1].any()
    u, _, vh = torch.linalg.svd(momentum[2].double(), full_matrices=False)
    torch.testing.assert_close(per_expert[2], (u @ vh * (2.0 / (u @ vh).norm())).float())
