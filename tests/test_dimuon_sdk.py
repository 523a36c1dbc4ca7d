"""The Dimuon optimizer family (``DimuonOptimizerConfig`` at creation, ``DimuonParams`` per step) through the real
SDK against the real server, step by step equal to a reference written here: PEFT loads the run's initial adapter and
the test applies Tinker's documented rule itself (EMA momentum, global clipping, a direction of Frobenius norm
sqrt(rank) from the momentum's polar factor), computing the polar factor another way than the server does
(eigendecomposition of the Gram matrix instead of an SVD)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase

from tests.helpers import (
    BASE_MODEL,
    checkpoint_dir,
    datum_arrays,
    expect_user_error,
    forward_logprobs,
    make_datum,
    reference_logprobs,
    reference_peft_model,
)

RANK = 4
DATUM = make_datum([11, 42, 77, 103, 250], [301, 17, 96])
STEPS = [types.DimuonParams(learning_rate=0.02), types.DimuonParams(learning_rate=0.01, beta1=0.5),
         types.DimuonParams(learning_rate=0.02, grad_clip_norm=0.05)]


def polar_by_gram(m: torch.Tensor) -> torch.Tensor:
    """U Vᵀ of ``m`` as (m mᵀ)^-½ m (wide) or m (mᵀ m)^-½ (tall), by eigendecomposition, in float64; directions
    with a singular value below 1e-4 of the largest (eigenvalue below 1e-8 of it) count as absent, as documented."""
    m = m.double()
    if not m.abs().max() > 0:
        return torch.zeros_like(m)
    wide = m.shape[0] <= m.shape[1]
    gram = m @ m.T if wide else m.T @ m
    values, vectors = torch.linalg.eigh(gram)
    kept = values > 1e-8 * values.max()
    inv_sqrt = vectors[:, kept] @ torch.diag(values[kept] ** -0.5) @ vectors[:, kept].T
    return inv_sqrt @ m if wide else m @ inv_sqrt


def reference_run(model) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    momenta = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    _, _, weights = datum_arrays(DATUM)
    logprobs = []
    for hyper in STEPS:
        loss = -(reference_logprobs(model, DATUM) * torch.tensor(weights)).sum()
        grads = torch.autograd.grad(loss, params)
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        scale = min(1.0, hyper.grad_clip_norm / (norm + 1e-6)) if hyper.grad_clip_norm > 0 else 1.0
        with torch.no_grad():
            for p, g, m in zip(params, grads, momenta):
                m.mul_(hyper.beta1).add_(g.double() * scale, alpha=1 - hyper.beta1)
                d = polar_by_gram(m)
                if d.abs().max() > 0:
                    d = d * math.sqrt(RANK) / d.norm()
                p.sub_((hyper.learning_rate * d).float())
            logprobs.append(reference_logprobs(model, DATUM).detach())
    return logprobs


def test_dimuon_steps_equal_the_documented_rule(service_client, server, tiny_model_dir):
    run = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=3,
                                                     optimizer=types.DimuonOptimizerConfig()).result()
    initial = run.save_weights_for_sampler("dimuon-initial").result().path
    served = []
    for hyper in STEPS:
        run.forward_backward([DATUM], "cross_entropy").result()
        metrics = run.optim_step(hyper).result().metrics
        assert metrics["learning_rate"] == hyper.learning_rate
        served.append(forward_logprobs(run, DATUM))
    model = reference_peft_model(tiny_model_dir, checkpoint_dir(server.data_dir, initial), trainable=True)
    for step, (mine, theirs) in enumerate(zip(served, reference_run(model))):
        np.testing.assert_allclose(mine, theirs.numpy(), atol=2e-5, rtol=0, err_msg=f"after step {step + 1}")
    assert np.abs(served[-1] - served[0]).max() > 1e-3  # the steps did move the model


def test_a_dimuon_run_resumes_exactly_and_refuses_adam_params(service_client):
    run = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=4,
                                                     optimizer=types.DimuonOptimizerConfig()).result()
    for hyper in STEPS[:2]:
        run.forward_backward([DATUM], "cross_entropy").result()
        run.optim_step(hyper).result()
    state = run.save_state("dimuon-2").result().path
    run.forward_backward([DATUM], "cross_entropy").result()
    run.optim_step(STEPS[2]).result()
    resumed = service_client.create_training_client_from_state_with_optimizer(state).result()
    resumed.forward_backward([DATUM], "cross_entropy").result()
    resumed.optim_step(STEPS[2]).result()  # its momentum came back with it: the same step as the original run's
    np.testing.assert_allclose(forward_logprobs(resumed, DATUM), forward_logprobs(run, DATUM), atol=1e-6, rtol=0)
    expect_user_error(run.optim_step(types.AdamParams(learning_rate=1e-3)), "uses the dimuon optimizer")
    adam_run = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK).result()
    adam_run.forward_backward([DATUM], "cross_entropy").result()
    expect_user_error(adam_run.optim_step(STEPS[0]), "uses the adamw optimizer")


def test_an_unknown_optimizer_family_is_refused(service_client):
    with pytest.raises(tinker.RequestFailedError, match="optimizer_config"):
        service_client.create_lora_training_client(
            base_model=BASE_MODEL, rank=RANK, optimizer=OptimizerConfigBase(type="lion")).result()
