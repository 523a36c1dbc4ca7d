"""The trainer's LoRA on every model family hosted Tinker trains, in-process, against an independent reference.

For each family (``tests/families.py``): the adapter covers every weight matrix of the model — every matrix parameter
is either adapted or one of the kinds hosted Tinker leaves frozen — and the trainer's loss and every LoRA gradient
equal those of the reference: transformers' own model (experts run by its plain per-expert loop) whose weights are
``W + s·B·A`` per matrix and per expert, built in this test from the adapter's tensors by their hosted-Tinker meaning
(split projections as row slices, experts' gate and up as halves of ``gate_up_proj``), differentiated by autograd.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.func import functional_call

from adapters.trainer.actor import MultiLoRATrainer
from adapters.trainer.interface import LoraSpec, StepRequest
from shims.tinker.training_wire import DatumArrays
from tests.families import FAMILIES, family_dir, reference_model

TOKENS = [1, 7, 30, 2, 99, 140, 3, 5, 260, 11, 8, 400, 17, 21]

FROZEN = re.compile(r"(embed_tokens|embeddings\.weight|conv1d|norm|\.gate\.weight|router\.weight|shared_expert_gate|A_log|dt_bias|"
                    r"\.D$|sinks|_bias$|\.bias$|e_score_correction)")
"""Parameters hosted Tinker does not adapt: embeddings (a tied head's input side follows the head), convolutions,
norms, routers, Mamba's and DeltaNet's per-head scalars, biases."""


def _datum() -> DatumArrays:
    return DatumArrays(tokens=np.asarray(TOKENS[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1, dtype=np.float32)})


def _merged(reference, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> dict:
    """The reference's parameters with each LoRA pair added as ``scale·B·A``, where hosted Tinker's layout says."""
    params = dict(reference.named_parameters())
    merged = {}

    def add(name: str, delta: torch.Tensor, rows: slice | None = None, dim: int = 0) -> None:
        weight = merged.get(name, params[name])
        if rows is None:
            merged[name] = weight + delta
        else:
            index = torch.arange(weight.shape[dim])[rows]
            merged[name] = weight.index_add(dim, index, delta)

    for key, (a, b) in tensors.items():
        module_path, _, leaf = key.rpartition(".")
        owner = reference.get_submodule(module_path)
        if b.dim() == 3:  # experts: (E, out, in) per projection
            delta = scale * torch.bmm(b, a)
            if leaf == "down_proj" or not owner.has_gate:
                target = f"{module_path}.{leaf}"
                add(target, delta.transpose(1, 2) if owner.is_transposed else delta)
                continue
            half = delta.shape[1]
            part = 0 if leaf == "gate_proj" else 1
            if owner.is_transposed:  # (E, in, 2·I)
                rows = slice(part, None, 2) if not owner.is_concatenated else slice(part * half, (part + 1) * half)
                add(f"{module_path}.gate_up_proj", delta.transpose(1, 2), rows, dim=2)
            else:  # (E, 2·I, in)
                rows = slice(part, None, 2) if not owner.is_concatenated else slice(part * half, (part + 1) * half)
                add(f"{module_path}.gate_up_proj", delta, rows, dim=1)
            continue
        delta = scale * b @ a
        if f"{key}.weight" in params:
            add(f"{key}.weight", delta)
        elif key == "lm_head":  # tied: the one shared matrix
            add(next(n for n, p in params.items() if p is reference.get_output_embeddings().weight), delta)
        elif leaf in ("in_proj_q", "in_proj_k", "in_proj_v"):
            k = owner.key_dim
            start = {"in_proj_q": 0, "in_proj_k": k, "in_proj_v": 2 * k}[leaf]
            add(f"{module_path}.in_proj_qkv.weight", delta, slice(start, start + delta.shape[0]))
        elif leaf in ("gate_proj", "x_proj"):  # a Mamba mixer's in_proj
            start = 0 if leaf == "gate_proj" else owner.intermediate_size
            add(f"{module_path}.in_proj.weight", delta, slice(start, start + delta.shape[0]))
        else:
            raise AssertionError(f"the test does not know where {key} goes")
    return merged


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, model_cache):
    directory = family_dir(request.param)
    trainer = MultiLoRATrainer(str(directory))
    yield request.param, directory, trainer


def test_every_weight_matrix_is_adapted_or_frozen_as_hosted_tinker_leaves_it(family):
    name, directory, trainer = family
    reference = reference_model(directory)
    adapted = set()
    for key, slot in trainer.model.slots.items():
        module_path, _, leaf = key.rpartition(".")
        if slot.experts:
            adapted.add(f"{module_path}.{'down_proj' if leaf == 'down_proj' else 'gate_up_proj'}")
            adapted.add(f"{module_path}.up_proj")
        elif leaf in ("in_proj_q", "in_proj_k", "in_proj_v"):
            adapted.add(f"{module_path}.in_proj_qkv.weight")
        elif leaf in ("gate_proj", "x_proj") and "mixer" in module_path:
            adapted.add(f"{module_path}.in_proj.weight")
        adapted.add(f"{key}.weight")
    matrices = [n for n, p in reference.named_parameters() if p.dim() >= 2]
    left_out = [n for n in matrices if n not in adapted and not FROZEN.search(n)]
    assert not left_out, f"{name}: weight matrices no LoRA adapts: {left_out}"
    described = trainer.facts.lora_targets
    assert described["attn"] and described["unembed"] == ["lm_head"]
    if any(slot.experts for slot in trainer.model.slots.values()):
        assert any("experts" in target for target in described["mlp"]), described


def test_loss_and_every_gradient_equal_the_merged_reference(family):
    """A rank-4 adapter on every group, its B moved off zero so every gradient is non-trivial; the trainer's loss
    and gradients against the reference's, in fp32."""
    name, directory, trainer = family
    trainer.create("run", LoraSpec(rank=4, seed=5))
    adapter = trainer.adapters["run"]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in adapter.params:
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    result = trainer.forward_backward_batch([StepRequest("run", [_datum()], "cross_entropy", {}, False)])[0]
    assert not isinstance(result, Exception), result

    reference = reference_model(directory)
    reference.requires_grad_(False)
    leaves = {key: (a.clone().requires_grad_(), b.clone().requires_grad_())
              for key, (a, b) in trainer.model.tensors(adapter.name).items()}
    ids = torch.tensor([TOKENS[:-1]])
    logits = functional_call(reference, _merged(reference, leaves, adapter.scaling), (ids,)).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    loss = -logprobs.sum()
    loss.backward()

    np.testing.assert_allclose(result.outputs[0]["logprobs"], logprobs.detach().numpy(), atol=2e-5)
    assert result.metrics["loss:sum"] == pytest.approx(float(loss), abs=2e-4)
    ours = dict(zip(leaves, zip(adapter.params[0::2], adapter.params[1::2], strict=True), strict=True))
    for key, (a, b) in leaves.items():
        for mine, theirs, which in ((ours[key][0], a, "A"), (ours[key][1], b, "B")):
            assert theirs.grad is not None and theirs.grad.abs().max() > 0, f"{key} {which} gets no gradient"
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-4, rtol=1e-3,
                                       msg=lambda m, key=key, which=which: f"{name} {key} {which}: {m}")
    trainer.unload("run")
