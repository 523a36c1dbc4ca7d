"""The trainer's own LoRA execution (``adapters.lora``: rows grouped by adapter) against PEFT, computed independently
in the test: every loss's value, logprobs and gradient for adapters of different ranks and target layers in one mixed
batch; logprobs scored in chunks equal to scored at once, gradients included; and a checkpoint written by PEFT
itself loads and scores as PEFT scores it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import adapters.trainer.passes as passes_module
from adapters.trainer.actor import AdamHyper, LoraSpec, MultiLoRATrainer, StepRequest
from shims.losses import LOSSES, datum_loss, resolve_config
from shims.tinker.training_wire import DatumArrays
from tests.helpers import reference_peft_model

SPECS = {"wide": LoraSpec(rank=8, seed=1), "attn": LoraSpec(rank=2, seed=2, train_mlp=False, train_unembed=False),
         "mlp-head": LoraSpec(rank=4, seed=3, train_attn=False)}


def _datum(rng: np.random.Generator, n: int, loss_fn: str) -> DatumArrays:
    tokens = rng.integers(0, 500, size=n + 1)
    inputs = {"target_tokens": tokens[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = rng.uniform(0, 1, size=n).astype(np.float32)
    else:
        inputs |= {"logprobs": (-rng.exponential(size=n) - 5).astype(np.float32),
                   "advantages": rng.normal(size=n).astype(np.float32)}
    for name in LOSSES[loss_fn].server_inputs:  # what the server adds from the sampler's records
        inputs[name] = ((rng.uniform(size=n) < 0.5) if name.endswith("mask") else
                        -rng.exponential(size=n) - 5).astype(np.float32)
    return DatumArrays(tokens=tokens[:-1], loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """Three adapters (ranks 8, 2, 4; all layers / attention only / MLP + head), each moved off its initial weights,
    with their sampler checkpoints for the PEFT reference."""
    trainer = MultiLoRATrainer(str(tiny_model_dir))
    rng = np.random.default_rng(0)
    directories = {}
    for model_id, spec in SPECS.items():
        trainer.create(model_id, spec)
        trainer.forward_backward(model_id, [_datum(rng, 6, "cross_entropy")], "cross_entropy", {}, False)
        trainer.optim_step(model_id, AdamHyper(learning_rate=1e-2))
        directories[model_id] = tmp_path_factory.mktemp(model_id)
        trainer.save_for_sampler(model_id, str(directories[model_id]))
    return trainer, directories


def _reference(tiny_model_dir, directory, datum: DatumArrays, loss_fn: str) -> tuple[float, np.ndarray, list]:
    """Loss, target logprobs and gradient (A then B of every adapted layer, in model order) from PEFT."""
    model = reference_peft_model(tiny_model_dir, directory, trainable=True)
    logits = model(input_ids=torch.as_tensor(datum.tokens)[None]).logits[0].float()
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"])
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    inputs = {k: torch.tensor(v) for k, v in datum.loss_fn_inputs.items()}
    loss = datum_loss(loss_fn, logprobs, inputs, resolve_config(loss_fn, {}))
    loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if p.requires_grad]
    return float(loss.detach()), logprobs.detach().numpy(), grads


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_every_loss_in_a_mixed_batch_equals_peft(trained, tiny_model_dir, loss_fn):
    trainer, directories = trained
    rng = np.random.default_rng(len(loss_fn))
    data = {model_id: _datum(rng, 5 + 3 * i, loss_fn) for i, model_id in enumerate(SPECS)}
    requests = [StepRequest(model_id, [datum], loss_fn, {}, model_id == "attn") for model_id, datum in data.items()]
    results = trainer.forward_backward_batch(requests)
    try:
        for request, result in zip(requests, results, strict=True):
            loss, logprobs, grads = _reference(tiny_model_dir, directories[request.model_id],
                                               data[request.model_id], loss_fn)
            assert result.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
            np.testing.assert_allclose(result.outputs[0]["logprobs"], logprobs, atol=1e-5)
            mine = [p.grad for p in trainer.adapters[request.model_id].params]
            if request.forward_only:  # a forward-only row beside trained ones gets no gradient
                assert all(g is None for g in mine)
                continue
            assert len(mine) == len(grads)
            for got, want in zip(mine, grads, strict=True):
                np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=1e-4)
    finally:
        for model_id in SPECS:
            trainer.adapters[model_id].optimizer.zero_grad(set_to_none=True)


def test_logprobs_scored_in_chunks_equal_scored_at_once(trained, monkeypatch):
    """A datum longer than one chunk of logits: the same logprobs, loss and gradient as all positions at once."""
    trainer, _ = trained
    datum = _datum(np.random.default_rng(5), 23, "cross_entropy")

    def run() -> tuple[np.ndarray, list[torch.Tensor]]:
        result = trainer.forward_backward("mlp-head", [datum], "cross_entropy", {}, False)
        grads = [p.grad.clone() for p in trainer.adapters["mlp-head"].params]
        trainer.adapters["mlp-head"].optimizer.zero_grad(set_to_none=True)
        return result.outputs[0]["logprobs"], grads

    whole, whole_grads = run()
    monkeypatch.setattr(passes_module, "LOGITS_CHUNK_ELEMENTS", trainer.facts.vocab_size * 4)  # 6 chunks
    chunked, chunked_grads = run()
    np.testing.assert_allclose(chunked, whole, atol=1e-6)
    for got, want in zip(chunked_grads, whole_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_positions", [4096, 8], ids=["one chunk", "several chunks"])
def test_datums_scored_together_equal_each_scored_alone(trained, monkeypatch, chunk_positions):
    """A request's datums share the head's matmuls (``ModelPasses.target_logprobs_together``), packed whole into
    chunks, a datum longer than a chunk on its own: each datum's logprobs, and the gradient of a weighted sum, as
    when each is scored alone; targets of several tokens per position too."""
    trainer, _ = trained
    monkeypatch.setattr(passes_module, "LOGITS_CHUNK_ELEMENTS", trainer.facts.vocab_size * chunk_positions)
    passes = trainer.passes
    torch.manual_seed(0)
    lengths = [3, 5, 2, 11, 4, 6]
    widths = [1, 1, 1, 1, 2, 2]
    hiddens = [torch.randn(n, passes.head.base.in_features, requires_grad=True) for n in lengths]
    targets = [torch.randint(0, trainer.facts.vocab_size, (n, k) if k > 1 else (n,))
               for n, k in zip(lengths, widths, strict=True)]

    def gradients(scored: list[torch.Tensor]) -> list[torch.Tensor]:
        total = sum((i + 1) * s.sum() for i, s in enumerate(scored))
        return list(torch.autograd.grad(total, hiddens))

    together = passes.target_logprobs_together(hiddens, "mlp-head", targets)
    alone = [torch.log_softmax(passes.head.with_adapter(h, "mlp-head"), -1).gather(1, t.reshape(len(h), -1))
             .reshape(t.shape) for h, t in zip(hiddens, targets, strict=True)]
    for got, want in zip(together, alone, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(gradients(together), gradients(alone), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_written_by_peft_loads_and_scores_as_peft_scores_it(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    torch.manual_seed(0)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=32, init_lora_weights=False,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    peft.save_pretrained(str(tmp_path))
    datum = _datum(np.random.default_rng(1), 9, "cross_entropy")
    with torch.no_grad():
        logits = peft(input_ids=torch.as_tensor(datum.tokens)[None]).logits[0]
        expected = torch.log_softmax(logits, -1).gather(
            1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None])[:, 0].numpy()
    trainer = MultiLoRATrainer(str(tiny_model_dir))
    spec = trainer.load_state("from-peft", str(tmp_path), with_optimizer=False)
    assert (spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed) == (4, True, True, False)
    got = trainer.forward_backward("from-peft", [datum], "cross_entropy", {}, True).outputs[0]["logprobs"]
    np.testing.assert_allclose(got, expected, atol=1e-5)
