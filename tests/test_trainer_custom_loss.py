"""Custom losses in the multi-LoRA trainer, in-process: in a mixed batch, a custom loss that fails fails only its own
request, and every other request gets the rows, loss and gradient it gets alone."""

from __future__ import annotations

import operator

import numpy as np
import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from adapters.trainer.actor import LoraSpec, MultiLoRATrainer, StepRequest
from adapters.trainer.interface import AdamHyper, OptimRequest
from shims.custom_loss.graph import CustomLossLimits, compile_custom_loss
from shims.errors import UserError
from shims.tinker.training_wire import DatumArrays


def weighted(logprobs, weights, scale):
    loss = -(logprobs * weights).sum() * scale
    return loss, {"custom/weighted:sum": loss.detach(), "custom/tokens:mean": (weights > 0).sum()}


def tenth(logprobs, weights, scale):
    return -logprobs[10] * scale, {}  # index 10 is past the end of the short datum


def compiled(fn):
    handle = trace_loss(fn, {"logprobs": 1, "weights": 1, "scale": 0}, "s")
    return compile_custom_loss(handle.name, handle.inputs, encode_graph(handle).nodes, CustomLossLimits())


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return MultiLoRATrainer(str(tiny_model_dir))


def datum(rng, n: int, scale: float) -> DatumArrays:
    tokens = rng.integers(0, 500, size=n + 1)
    return DatumArrays(tokens=tokens[:-1], loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": rng.uniform(0, 1, size=n).astype(np.float32),
        "scale": np.array(scale, np.float32), "ignored": np.zeros(n, np.float32)})


def plain(d: DatumArrays) -> DatumArrays:
    """The datum for cross_entropy: its tokens, targets and weights."""
    return DatumArrays(tokens=d.tokens, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")})


def grads(trainer, model_id):
    return [p.grad.clone() for p in trainer.adapters[model_id].params if p.grad is not None]


def test_a_failing_custom_loss_leaves_the_batch_and_the_other_requests_intact(trainer):
    rng = np.random.default_rng(3)
    for model_id in ("a", "b", "c"):
        trainer.create(model_id, LoraSpec(rank=4, seed=7))
    a_data = [datum(rng, 7, 2.0), datum(rng, 4, 0.5)]
    b_data = [datum(rng, 5, 1.0), datum(rng, 12, 1.0)]  # tenth() fails on the first: the second is never read
    c_data = [DatumArrays(tokens=d.tokens, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens",
                                                                                               "weights")})
              for d in (datum(rng, 6, 1.0), datum(rng, 3, 1.0))]
    requests = [StepRequest("a", a_data, "custom", {}, False, custom_loss=compiled(weighted)),
                StepRequest("b", b_data, "custom", {}, False, custom_loss=compiled(tenth)),
                StepRequest("c", c_data, "cross_entropy", {}, False)]
    together = trainer.forward_backward_batch(requests)
    assert isinstance(together[1], UserError) and "custom loss 'tenth'" in str(together[1])
    assert "IndexError" in str(together[1])
    batched_grads = {m: grads(trainer, m) for m in ("a", "c")}
    assert not grads(trainer, "b")  # the failed request added nothing
    for model_id in ("a", "c"):
        for p in trainer.adapters[model_id].params:
            p.grad = None

    for index, request in ((0, requests[0]), (2, requests[2])):
        alone = trainer.forward_backward_batch([request])[0]
        assert alone.metrics == pytest.approx(together[index].metrics, rel=1e-5)
        for x, y in zip(alone.outputs, together[index].outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
        for x, y in zip(grads(trainer, request.model_id), batched_grads[request.model_id]):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)

    metrics = together[0].metrics
    expected = sum(-(o["logprobs"] * d.loss_fn_inputs["weights"]).sum() * float(d.loss_fn_inputs["scale"])
                   for o, d in zip(together[0].outputs, a_data))
    assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert metrics["custom/weighted:sum"] == pytest.approx(expected, rel=1e-5)
    assert metrics["custom/tokens:mean"] == pytest.approx(np.mean([(d.loss_fn_inputs["weights"] > 0).sum()
                                                                   for d in a_data]))


def test_custom_datums_are_checked_before_anything_runs(trainer):
    trainer.create("d", LoraSpec(rank=2, seed=1))
    rng = np.random.default_rng(4)
    bad = datum(rng, 5, 1.0)
    del bad.loss_fn_inputs["scale"]
    outcome = trainer.forward_backward_batch([StepRequest("d", [bad], "custom", {}, False,
                                                          custom_loss=compiled(weighted))])[0]
    assert isinstance(outcome, UserError) and "no loss_fn_inputs['scale']" in str(outcome)
    detached = trace_loss(lambda logprobs: (logprobs.detach().sum(), {}), {"logprobs": 1}, "s")
    loss = compile_custom_loss("detached", detached.inputs, encode_graph(detached).nodes, CustomLossLimits())
    plain = DatumArrays(tokens=bad.tokens, loss_fn_inputs={"target_tokens": bad.loss_fn_inputs["target_tokens"]})
    outcome = trainer.forward_backward_batch([StepRequest("d", [plain], "custom", {}, False, custom_loss=loss)])[0]
    assert isinstance(outcome, UserError) and "does not depend on logprobs" in str(outcome)
    assert not grads(trainer, "d")
    forward = trainer.forward_backward_batch([StepRequest("d", [plain], "custom", {}, True, custom_loss=loss)])[0]
    assert forward.metrics["loss:sum"] == pytest.approx(float(forward.outputs[0]["logprobs"].sum()), rel=1e-5)
    with pytest.raises(UserError, match="unknown loss_fn 'custom'"):  # only ever with its stored loss
        trainer.forward_backward("d", [plain], "custom", {"loss_id": "x"}, False)


def on_meta(logprobs, weights, scale):
    return logprobs.to("meta").sum(), {}  # passes every check made before it runs: its value is on no device


def floor_divided(logprobs, weights, scale):
    return operator.floordiv(logprobs, logprobs).sum(), {}  # runs forward; its backward raises


def bad_metric(logprobs, weights, scale):
    return -logprobs.sum(), {"custom/bad:sum": logprobs.to("meta").sum()}


@pytest.mark.parametrize("hostile", [on_meta, floor_divided, bad_metric])
def test_a_custom_loss_that_breaks_the_shared_passes_fails_alone(trainer, hostile):
    """Issue 31, rows 1 and 2: a custom loss whose value is on another device, whose backward raises, or whose
    metric cannot be read, in one ``run_batch`` with another run's forward_backward and a third run's optim step.
    The hostile request alone fails, as a user error; the other run gets the loss, logprobs and gradient it gets
    alone, and the optim step is reported as applied (it was)."""
    rng = np.random.default_rng(11)
    victim, stepper, attacker = (f"{hostile.__name__}-{role}" for role in ("victim", "stepper", "attacker"))
    for model_id in (victim, stepper, attacker):
        trainer.create(model_id, LoraSpec(rank=4, seed=3))
    honest = StepRequest(victim, [plain(datum(rng, 7, 1.0)), plain(datum(rng, 4, 1.0))], "cross_entropy", {}, False)
    alone = trainer.forward_backward_batch([honest])[0]
    alone_grads = grads(trainer, victim)
    trainer.adapters[victim].optimizer.zero_grad(set_to_none=True)
    trainer.forward_backward(stepper, [plain(datum(rng, 5, 1.0))], "cross_entropy", {}, False)
    step_before = trainer.adapters[stepper].step

    outcomes = trainer.run_batch([
        OptimRequest(stepper, AdamHyper(learning_rate=1e-2)), honest,
        StepRequest(attacker, [datum(rng, 6, 1.0)], "custom", {}, False, custom_loss=compiled(hostile))])
    assert isinstance(outcomes[0], dict) and outcomes[0]["step"] == step_before + 1
    assert trainer.adapters[stepper].step == step_before + 1
    assert isinstance(outcomes[2], UserError) and f"custom loss {hostile.__name__!r}" in str(outcomes[2])
    assert not grads(trainer, attacker)
    together = outcomes[1]
    assert together.metrics == pytest.approx(alone.metrics, rel=1e-5)
    for x, y in zip(alone.outputs, together.outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    for x, y in zip(alone_grads, grads(trainer, victim), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
