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
from adapters.trainer.packing import buckets
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


def _perturbed(trainer: MultiLoRATrainer, name: str, seed: int = 3) -> None:
    """Move every LoRA weight of run ``name`` off its initial value (B off zero), deterministically."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.adapters[name].params:
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


FUSED = {"qwen3_5_moe": ("in_proj_qkv", 3), "nemotron_h": ("in_proj", 2)}
"""Families with a projection trained as parts: the fused module's leaf and its number of parts."""


@pytest.mark.parametrize("name", list(FUSED))
def test_a_projection_trained_as_parts_is_stored_fused_and_read_back_exactly(name, model_cache, tmp_path):
    """Stored (the sampler's and training checkpoints' layout), the parts are one pair on the model's fused module,
    as PEFT and vLLM load it: A stacked, B block-diagonal, rank and alpha scaled by the parts in ``rank_pattern`` /
    ``alpha_pattern``. Read back, the run's tensors come back bit for bit."""
    import json

    from safetensors.torch import load_file

    leaf, parts = FUSED[name]
    trainer = MultiLoRATrainer(str(family_dir(name)))
    trainer.create("run", LoraSpec(rank=4, seed=5))
    _perturbed(trainer, "run")
    trainer.save_for_sampler("run", str(tmp_path / "stored"))
    config = json.loads((tmp_path / "stored" / "adapter_config.json").read_text())
    state = load_file(tmp_path / "stored" / "adapter_model.safetensors")
    assert config["rank_pattern"] == {leaf: 4 * parts}
    assert config["alpha_pattern"] == {leaf: config["lora_alpha"] * parts}
    assert leaf in config["target_modules"]
    fused_b = [key for key in state if key.endswith(f".{leaf}.lora_B.weight")]
    assert fused_b and not any(re.search(r"\.(in_proj_[qkv]|x_proj)\.", key) for key in state)
    for key in fused_b:
        b = state[key]
        assert b.shape[1] == 4 * parts and state[key.replace("lora_B", "lora_A")].shape[0] == 4 * parts
        block = torch.block_diag(*[torch.ones(rows, 4) for rows in _part_rows(b.shape[0], trainer, key)])
        assert not b[block == 0].any() and b[block == 1].abs().min() > 0

    trainer.load_state("copy", str(tmp_path / "stored"), with_optimizer=False)
    original, copied = trainer.model.tensors(trainer.adapters["run"].name), trainer.model.tensors(
        trainer.adapters["copy"].name)
    assert original.keys() == copied.keys()
    for key, (a, b) in original.items():
        assert torch.equal(copied[key][0], a) and torch.equal(copied[key][1], b), key


def _part_rows(total: int, trainer: MultiLoRATrainer, key: str) -> list[int]:
    path = key.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
    rows = [slot.out_features for slot in trainer.model.modules[path].lora.slots]
    assert sum(rows) == total
    return rows


@pytest.mark.parametrize("name", list(FUSED))
def test_a_peft_adapter_on_the_fused_module_is_read_as_parts_sharing_its_a(name, model_cache, tmp_path):
    """An adapter trained elsewhere with PEFT on the fused module itself (rank r, no ``rank_pattern``) is exact as
    parts that each keep A whole: its scores equal the reference's ``W + s·B·A`` on the fused weight. Of rank
    parts × r but not block-diagonal it cannot be split, and is refused as a user error."""
    import json

    from peft import LoraConfig
    from safetensors.torch import save_file

    from shims.errors import UserError

    leaf, parts = FUSED[name]
    directory = family_dir(name)
    trainer = MultiLoRATrainer(str(directory))
    path = next(path for path in trainer.model.modules if path.endswith(f".{leaf}"))
    weight = trainer.model.modules[path].base.weight
    generator = torch.Generator().manual_seed(7)
    a = torch.randn(4, weight.shape[1], generator=generator) * 0.2
    b = torch.randn(weight.shape[0], 4, generator=generator) * 0.2
    out = tmp_path / "peft"
    out.mkdir()
    save_file({f"base_model.model.{path}.lora_A.weight": a, f"base_model.model.{path}.lora_B.weight": b},
              str(out / "adapter_model.safetensors"))
    LoraConfig(r=4, lora_alpha=8, target_modules=[leaf]).save_pretrained(str(out))

    reference = reference_model(directory)
    with torch.no_grad():
        reference.get_submodule(path).weight += 2.0 * b @ a
        logits = reference(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    np.testing.assert_allclose(trainer.score(str(out), TOKENS), expected.numpy(), atol=2e-5)

    full = torch.randn(weight.shape[0], 4 * parts, generator=generator)
    save_file({f"base_model.model.{path}.lora_A.weight": torch.randn(4 * parts, weight.shape[1]),
               f"base_model.model.{path}.lora_B.weight": full}, str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(rank_pattern={leaf: 4 * parts}, alpha_pattern={leaf: 8 * parts})
    (out / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="not block-diagonal"):
        trainer.load_state("dense", str(out), with_optimizer=False)
    config.update(alpha_pattern={leaf: 8})
    (out / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="one scale per adapter"):
        trainer.load_state("dense", str(out), with_optimizer=False)


def test_peft_itself_loads_the_stored_fused_mamba_projection(model_cache, tmp_path):
    """The stored layout is PEFT's: ``PeftModel.from_pretrained`` on transformers' own Nemotron-H (no MoE layers,
    whose per-expert keys PEFT cannot place) scores as the trainer does the same file, the Mamba ``in_proj`` at its
    ``rank_pattern`` / ``alpha_pattern`` included. PEFT refuses LoRA on a Mamba ``out_proj`` (its CUDA training
    kernel reads that weight directly; the trainer keeps the model in eval mode, where transformers never takes that
    path), so the file compared leaves ``out_proj`` out."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    directory = family_dir("nemotron_h_dense")
    trainer = MultiLoRATrainer(str(directory))
    trainer.create("run", LoraSpec(rank=4, seed=5))
    _perturbed(trainer, "run")
    stored = tmp_path / "stored"
    trainer.save_for_sampler("run", str(stored))
    state = load_file(stored / "adapter_model.safetensors")
    assert any(".mixer.out_proj." in key for key in state)
    save_file({k: v for k, v in state.items() if ".mixer.out_proj." not in k}, str(stored / "adapter_model.safetensors"))
    config = json.loads((stored / "adapter_config.json").read_text())
    config["target_modules"] = [leaf for leaf in config["target_modules"] if leaf != "out_proj"]
    (stored / "adapter_config.json").write_text(json.dumps(config))

    model = PeftModel.from_pretrained(reference_model(directory), str(stored))
    assert model.peft_config["default"].rank_pattern == {"in_proj": 8}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()
    assert np.abs(expected - np.asarray(trainer.score(None, TOKENS))).max() > 1e-3, "the adapter changes nothing"
    np.testing.assert_allclose(trainer.score(str(stored), TOKENS), expected, atol=2e-5)


def test_checkpointed_layers_give_the_same_loss_and_gradients_in_a_mixed_batch(family):
    """With every decoder layer checkpointed (``adapters.trainer.recompute``: recomputed in backward, its routing
    restored), a mixed batch of two adapters of different lengths runs as one batch (each layer checkpointed once per
    forward)
    and gets the loss, logprobs and gradients it gets with every activation kept, on every family's layers
    (experts, MLA, DeltaNet, Mamba). It also caught mixed batches failing on Qwen3.5's shared expert, which sees
    the batch's tokens flattened (they fell back to running one by one)."""
    name, _, trainer = family
    second = [5, 300, 17, 2, 99, 140, 3, 77, 260, 8, 11]
    data = [_datum(), DatumArrays(tokens=np.asarray(second[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray(second[1:]), "weights": np.ones(len(second) - 1, dtype=np.float32)})]
    outcomes = {}
    chosen = trainer.passes.recompute.min_tokens
    for recompute in (False, True):
        trainer.passes.recompute.min_tokens = 1 if recompute else 0
        for run, seed in (("a", 5), ("b", 6)):
            trainer.create(run, LoraSpec(rank=4, seed=seed))
            _perturbed(trainer, run, seed)
        calls: list[int] = []

        def counted(*args, _calls=calls, **kwargs):
            _calls.append(1)
            return torch.utils.checkpoint.checkpoint(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("adapters.trainer.recompute.checkpoint", counted)
            results = trainer.forward_backward_batch([StepRequest("a", data[:1], "cross_entropy", {}, False),
                                                      StepRequest("b", data[1:], "cross_entropy", {}, False)])
        # One packed forward; a recurrent family's one forward per length bucket (adapters.trainer.packing).
        forwards = 1 if trainer.passes.packs else len(buckets([d.tokens.size for d in data]))
        assert len(calls) == (len(trainer.passes.recompute.layers) * forwards if recompute else 0)
        outcomes[recompute] = (results, {run: [p.grad.clone() for p in trainer.adapters[run].params]
                                         for run in ("a", "b")})
        for run in ("a", "b"):
            trainer.unload(run)
    trainer.passes.recompute.min_tokens = chosen
    (kept, kept_grads), (recomputed, recomputed_grads) = outcomes[False], outcomes[True]
    for mine, theirs in zip(recomputed, kept, strict=True):
        assert mine.metrics["loss:sum"] == pytest.approx(theirs.metrics["loss:sum"], rel=1e-6, abs=1e-6)
        np.testing.assert_allclose(mine.outputs[0]["logprobs"], theirs.outputs[0]["logprobs"], atol=1e-6)
    for run in ("a", "b"):
        for mine, theirs in zip(recomputed_grads[run], kept_grads[run], strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, run=run: f"{name} {run}: {m}")


def test_the_measured_activations_per_token_predict_a_batch_and_decide_its_checkpointing(family):
    """The trainer measures what its model keeps for backward per token when it starts (two short probe passes,
    ``adapters.trainer.memory``). On every family that figure predicts what a mixed batch of other lengths keeps, and
    a training pass checkpoints its layers exactly when that would exceed its share of the free memory: all of them
    when it would not fit, none when it would; and one that would not fit even checkpointed is refused before it
    runs."""
    from adapters.trainer import memory

    name, _, trainer = family
    budget = trainer.passes.recompute.budget
    assert budget is not None and budget.per_token > 0, f"{name}: no measurement ({trainer.facts.checkpointing})"
    assert "KiB per token" in trainer.facts.checkpointing
    lengths = [300, 37, 200, 511]
    data = [DatumArrays(tokens=np.arange(n, dtype=np.int64) * 7 % 500 + 1, loss_fn_inputs={
        "target_tokens": np.arange(1, n + 1, dtype=np.int64) * 7 % 500 + 1, "weights": np.ones(n, np.float32)})
        for n in lengths]
    trainer.create("measured", LoraSpec(rank=32, seed=2))
    kept = []
    for batch in (data[:1], data):  # the difference: what the further tokens keep, without what every pass keeps
        with torch.enable_grad(), memory.counting_saved() as saved:
            trainer.passes.hidden(batch, [trainer.adapters["measured"].name] * len(batch))
        kept.append(saved.total)
    tokens = sum(lengths) - lengths[0]
    assert (kept[1] - kept[0]) / tokens == pytest.approx(budget.per_token, rel=0.15), name

    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return torch.utils.checkpoint.checkpoint(*args, **kwargs)

    total = sum(lengths)
    for share, checkpointed in ((1.01, False), (0.99, True)):
        free = int(total * budget.per_token / memory.KEEP_SHARE * share)
        calls.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("adapters.trainer.recompute.checkpoint", counted)
            patch.setattr(memory, "available_bytes", lambda device, free=free: free)
            [outcome] = trainer.forward_backward_batch([StepRequest("measured", data, "cross_entropy", {}, False)])
        assert not isinstance(outcome, Exception), outcome
        forwards = 1 if trainer.passes.packs else len(buckets(lengths))
        assert len(calls) == (len(trainer.passes.recompute.layers) * forwards if checkpointed else 0), (name, share)
    # Too little even checkpointed: refused before the pass (no layer runs), as on every shard of a sharded trainer.
    free = int(total * budget.checkpointed_per_token / memory.KEEP_SHARE * 0.99)
    calls.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("adapters.trainer.recompute.checkpoint", counted)
        patch.setattr(memory, "available_bytes", lambda device, free=free: free)
        [outcome] = trainer.forward_backward_batch([StepRequest("measured", data, "cross_entropy", {}, False)])
    assert isinstance(outcome, memory.DoesNotFit) and f"{total} tokens" in str(outcome), (name, outcome)
    assert not calls
    trainer.unload("measured")
