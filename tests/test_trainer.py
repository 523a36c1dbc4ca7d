"""The multi-LoRA trainer in-process: failures leave adapters exactly as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest
from peft import LoraConfig
from safetensors.torch import load_file

from adapters.trainer.actor import AdamHyper, LoraSpec, MultiLoRATrainer
from adapters.trainer.options import TrainerOptions
from shims.errors import UserError
from shims.tinker.training_wire import DatumArrays

TOKENS = np.array([5, 6, 7, 8, 9, 10], dtype=np.int64)
DATUM = DatumArrays(tokens=TOKENS[:-1], loss_fn_inputs={"target_tokens": TOKENS[1:],
                                                         "weights": np.ones(5, np.float32)})


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return MultiLoRATrainer(str(tiny_model_dir))


def logprobs(trainer, model_id):
    return trainer.forward_backward(model_id, [DATUM], "cross_entropy", {}, True).outputs[0]["logprobs"]


def test_a_failed_load_leaves_the_current_adapter_untouched(trainer, tmp_path):
    trainer.create("m", LoraSpec(rank=4, seed=1))
    trainer.forward_backward("m", [DATUM], "cross_entropy", {}, False)
    trainer.optim_step("m", AdamHyper(learning_rate=1e-2))
    trainer.save_state("m", str(tmp_path / "good"))
    before = logprobs(trainer, "m")
    trainer.forward_backward("m", [DATUM], "cross_entropy", {}, False)
    trainer.optim_step("m", AdamHyper(learning_rate=1e-2))
    trained = logprobs(trainer, "m")

    (tmp_path / "good" / "adapter_model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(UserError, match="could not be loaded"):
        trainer.load_state("m", str(tmp_path / "good"), with_optimizer=True)
    np.testing.assert_array_equal(logprobs(trainer, "m"), trained)
    assert trainer.adapters["m"].step == 2 and list(trainer.adapters) == ["m"]
    assert not np.allclose(before, trained)


def test_zero_eps_and_non_finite_gradients_never_reach_the_weights(trainer):
    trainer.create("e", LoraSpec(rank=2, seed=2))
    trainer.forward_backward("e", [DATUM], "cross_entropy", {}, False)
    start = logprobs(trainer, "e")
    with pytest.raises(UserError, match="eps must be > 0"):
        trainer.optim_step("e", AdamHyper(eps=0.0))
    for hyper in (AdamHyper(learning_rate=1e38), AdamHyper(learning_rate=1e36, beta1=0.999),
                  AdamHyper(learning_rate=1e20, weight_decay=1e20), AdamHyper(weight_decay=1e39)):
        with pytest.raises(UserError, match="float32"):  # would overflow inside the optimizer: a server error
            trainer.optim_step("e", hyper)
    huge = DatumArrays(tokens=DATUM.tokens, loss_fn_inputs={**DATUM.loss_fn_inputs,
                                                            "weights": np.full(5, 3e38, np.float32)})
    with pytest.raises(UserError, match="not finite"):
        trainer.forward_backward("e", [huge], "cross_entropy", {}, False)
    np.testing.assert_array_equal(logprobs(trainer, "e"), start)
    assert trainer.optim_step("e", AdamHyper())["step"] == 1.0


def _datum(rng, n: int, rl: bool = False) -> DatumArrays:
    tokens = rng.integers(0, 500, size=n + 1)
    inputs = {"target_tokens": tokens[1:]}
    if rl:
        inputs |= {"logprobs": (-rng.exponential(size=n) - 5).astype(np.float32),
                   "advantages": rng.normal(size=n).astype(np.float32)}
    else:
        inputs["weights"] = rng.uniform(0, 1, size=n).astype(np.float32)
    return DatumArrays(tokens=tokens[:-1], loss_fn_inputs=inputs)


def test_a_mixed_adapter_batch_equals_each_adapter_alone(tiny_model_dir):
    """Runs of different ranks, layers and losses in one batch: each gets the loss, logprobs and gradient it gets
    alone (fp tolerance), a forward-only request adds no gradient, and a bad request fails alone."""
    from adapters.trainer.actor import StepRequest

    trainer = MultiLoRATrainer(str(tiny_model_dir))
    specs = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=8, seed=2, train_mlp=False),
             "c": LoraSpec(rank=2, seed=3, train_attn=False, train_unembed=False), "d": LoraSpec(rank=4, seed=4)}
    rng = np.random.default_rng(0)
    for model_id, spec in specs.items():  # one step each, so LoRA A and B both carry gradient afterwards
        trainer.create(model_id, spec)
        trainer.forward_backward(model_id, [_datum(rng, 6)], "cross_entropy", {}, False)
        trainer.optim_step(model_id, AdamHyper(learning_rate=1e-2))
    requests = [StepRequest("a", [_datum(rng, 9), _datum(rng, 4)], "cross_entropy", {}, False),
                StepRequest("b", [_datum(rng, 7, rl=True)], "ppo", {}, False),
                StepRequest("c", [_datum(rng, 12, rl=True)], "importance_sampling", {}, False),
                StepRequest("d", [_datum(rng, 5)], "cross_entropy", {}, True)]

    def grads(model_id):
        return [None if p.grad is None else p.grad.clone() for p in trainer.adapters[model_id].params]

    alone, alone_grads = [], {}
    for request in requests:
        alone.append(trainer.forward_backward(request.model_id, request.data, request.loss_fn, {},
                                              request.forward_only))
        alone_grads[request.model_id] = grads(request.model_id)
        trainer.adapters[request.model_id].optimizer.zero_grad(set_to_none=True)

    bad = StepRequest("a", [DatumArrays(tokens=np.array([1, 2]), loss_fn_inputs={"target_tokens": np.array([2])})],
                      "cross_entropy", {}, False)
    together = trainer.forward_backward_batch([*requests, bad, StepRequest("nobody", [DATUM], "cross_entropy", {},
                                                                             False)])
    assert isinstance(together[-2], UserError) and "weights" in str(together[-2])
    assert isinstance(together[-1], UserError) and "not loaded" in str(together[-1])
    for request, solo, mixed in zip(requests, alone, together, strict=False):
        assert mixed.metrics["loss:sum"] == pytest.approx(solo.metrics["loss:sum"], rel=1e-5)
        for out_solo, out_mixed in zip(solo.outputs, mixed.outputs, strict=True):
            np.testing.assert_allclose(out_mixed["logprobs"], out_solo["logprobs"], atol=1e-5)
        for g_solo, g_mixed in zip(alone_grads[request.model_id], grads(request.model_id), strict=True):
            if request.forward_only:
                assert g_mixed is None and g_solo is None
            else:
                assert g_mixed is not None and g_solo is not None
                np.testing.assert_allclose(g_mixed.numpy(), g_solo.numpy(), atol=1e-5, rtol=1e-4)


def test_a_request_whose_activations_would_not_fit_fails_alone_before_its_pass(tiny_model_dir):
    """Issue 44: a pass too large for memory failed inside the pass (on the CPU: the process killed; on a sharded
    trainer: the group). Now a pass that would not fit even with every layer recomputed is refused before it runs,
    naming the limit: in a mixed batch only that request fails, and the others get what they get alone, one of them
    large enough to be checkpointed."""
    from adapters.trainer.actor import StepRequest
    from adapters.trainer.memory import KEEP_SHARE, DoesNotFit

    trainer = MultiLoRATrainer(str(tiny_model_dir), TrainerOptions(activation_memory_mib=4))
    budget = trainer.passes.recompute.budget
    most = int(KEEP_SHARE * 4 * 2**20 / budget.checkpointed_per_token)  # the longest pass that fits, checkpointed
    assert not budget.fits(int(0.7 * most)) and trainer.passes.recompute.checkpoints(int(0.7 * most))
    rng = np.random.default_rng(3)
    for model_id in "abc":
        trainer.create(model_id, LoraSpec(rank=4, seed=ord(model_id)))
    requests = [StepRequest("a", [_datum(rng, 16)], "cross_entropy", {}, False),
                StepRequest("b", [_datum(rng, int(0.7 * most))], "cross_entropy", {}, False),
                StepRequest("c", [_datum(rng, int(0.6 * most)) for _ in range(2)], "cross_entropy", {}, False)]
    alone = [trainer.forward_backward_batch([request])[0] for request in requests]
    assert isinstance(alone[2], DoesNotFit) and "--activation-memory-mib" in str(alone[2])
    assert f"{2 * int(0.6 * most)} tokens" in str(alone[2])
    together = trainer.forward_backward_batch(requests)
    assert isinstance(together[2], DoesNotFit)
    for solo, mixed in zip(alone[:2], together[:2], strict=True):
        assert mixed.metrics["loss:sum"] == pytest.approx(solo.metrics["loss:sum"], rel=1e-5)
        np.testing.assert_allclose(mixed.outputs[0]["logprobs"], solo.outputs[0]["logprobs"], atol=1e-5)


def test_short_datums_whose_logits_would_not_fit_recompute_them_with_the_same_results(tiny_model_dir):
    """A batch of short datums kept every datum's float32 log-softmax (vocabulary × 4 bytes a token: 590 KiB at a
    151k vocabulary, more than a checkpointed pass keeps in its layers) for backward, whatever the memory. Now a pass
    keeps them only when they fit beside its layers' activations, else recomputes them in backward like a long
    datum's chunks: the loss, logprobs and gradients are the same as keeping them."""
    import math

    from adapters.trainer.actor import StepRequest

    rng = np.random.default_rng(4)
    data = [_datum(rng, 20) for _ in range(100)]
    tokens = 20 * 100
    outcomes = []
    cap = None
    for _ in range(2):
        trainer = MultiLoRATrainer(str(tiny_model_dir), TrainerOptions(activation_memory_mib=cap))
        if cap is None:  # the layers' activations fit in the room left, with their logits they do not
            layers, logits = tokens * trainer.passes.recompute.budget.per_token, tokens * 512 * 4
            cap = math.ceil(3 * (layers + logits / 2) / 2**20)
        trainer.create("a", LoraSpec(rank=4, seed=5))
        [result] = trainer.forward_backward_batch([StepRequest("a", data, "cross_entropy", {}, False)])
        outcomes.append((result, [p.grad.clone() for p in trainer.adapters["a"].params], trainer.passes.keeps_logits,
                         trainer.passes.recompute.checkpoints(tokens)))
    (kept, kept_grads, *kept_flags), (recomputed, recomputed_grads, *recomputed_flags) = outcomes
    assert kept_flags == [True, False] and recomputed_flags == [False, False]
    assert recomputed.metrics["loss:sum"] == pytest.approx(kept.metrics["loss:sum"], rel=1e-6)
    for mine, theirs in zip(recomputed.outputs, kept.outputs, strict=True):
        np.testing.assert_allclose(mine["logprobs"], theirs["logprobs"], atol=1e-6)
    for mine, theirs in zip(recomputed_grads, kept_grads, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6, rtol=1e-5)


def test_the_adapter_limit_is_a_clear_user_error(tiny_model_dir):
    trainer = MultiLoRATrainer(str(tiny_model_dir), TrainerOptions(max_adapters=2))
    trainer.create("one", LoraSpec(rank=2, seed=0))
    trainer.create("two", LoraSpec(rank=2, seed=0))
    with pytest.raises(UserError, match="already holds 2 training runs"):
        trainer.create("three", LoraSpec(rank=2, seed=0))
    trainer.unload("one")
    trainer.create("three", LoraSpec(rank=2, seed=0))


def test_a_tied_models_unembedding_lora_changes_the_one_shared_matrix(tiny_model_dir, tmp_path):
    """The tiny model embeds and unembeds with one matrix W. An adapter with LoRA on the unembedding only must be the
    model whose shared matrix is W + scale·B·A (an independent reference: plain transformers, no PEFT); its stored
    directory gives that model under PEFT, and its export (hosted Tinker's names) loads back to the same numbers."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer = MultiLoRATrainer(str(tiny_model_dir))
    assert trainer.model.tied
    trainer.create("u", LoraSpec(rank=4, seed=9, train_attn=False, train_mlp=False))
    for _ in range(3):
        trainer.forward_backward("u", [DATUM], "cross_entropy", {}, False)
        trainer.optim_step("u", AdamHyper(learning_rate=1e-2))
    served = logprobs(trainer, "u")
    trainer.save_for_sampler("u", str(tmp_path / "stored"))
    trainer.save_for_export("u", str(tmp_path / "exported"))

    stored = load_file(tmp_path / "stored" / "adapter_model.safetensors")
    a, b = stored["base_model.model.lm_head.lora_A.weight"], stored["base_model.model.lm_head.lora_B.weight"]
    assert b.abs().max() > 1e-3
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight += 32 / 4 * b @ a  # LORA_ALPHA / rank
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        tokens = torch.tensor([DATUM.tokens])
        targets = torch.tensor(DATUM.loss_fn_inputs["target_tokens"])[:, None]

        def score(m):
            return torch.log_softmax(m(input_ids=tokens).logits[0], -1).gather(1, targets)[:, 0].numpy()

        np.testing.assert_allclose(served, score(model), atol=1e-5, rtol=0)
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        assert np.abs(served - score(base)).max() > 1e-2
        np.testing.assert_allclose(served, score(PeftModel.from_pretrained(base, str(tmp_path / "stored"))),
                                   atol=1e-5, rtol=0)

    exported = load_file(tmp_path / "exported" / "adapter_model.safetensors")
    assert sorted(exported) == ["base_model.model.model.unembed_tokens.lora_A.weight",
                                "base_model.model.model.unembed_tokens.lora_B.weight"]
    trainer.load_state("back", str(tmp_path / "exported"), with_optimizer=False)
    np.testing.assert_array_equal(logprobs(trainer, "back"), served)


def test_a_rank_one_adapter_on_a_tied_model_is_saved_and_loads_back(tiny_model_dir, tmp_path):
    """At rank 1 a tied unembedding's input-side tensors (the head's A and B transposed) are already contiguous, so
    they were the head's own tensors, and safetensors refused to write names sharing memory: such runs could never
    be checkpointed (issue 44). Saved state and sampler weights now load back to the same scores."""
    trainer = MultiLoRATrainer(str(tiny_model_dir))
    assert trainer.model.tied
    trainer.create("one", LoraSpec(rank=1, seed=2))
    trainer.forward_backward("one", [DATUM], "cross_entropy", {}, False)
    trainer.optim_step("one", AdamHyper(learning_rate=1e-2))
    trainer.save_state("one", str(tmp_path / "state"))
    trainer.save_for_sampler("one", str(tmp_path / "sampler"))
    trainer.load_state("back", str(tmp_path / "state"), with_optimizer=True)
    np.testing.assert_array_equal(logprobs(trainer, "back"), logprobs(trainer, "one"))


def test_an_adapter_handed_in_memory_is_the_one_its_files_hold(trainer, tmp_path):
    """``sampler_tensors`` (an unnamed save's hand-off: no file) holds what ``save_for_sampler`` writes, and the drift
    probe scores it as it scores the files."""
    trainer.create("handed", LoraSpec(rank=4, seed=3))
    for _ in range(2):
        trainer.forward_backward("handed", [DATUM], "cross_entropy", {}, False)
        trainer.optim_step("handed", AdamHyper(learning_rate=1e-2))
    nbytes, handed = trainer.sampler_tensors("handed")
    trainer.save_for_sampler("handed", str(tmp_path / "stored"))
    params = trainer.adapters["handed"].params
    assert handed.rank == 4 and nbytes == sum(p.numel() * 4 for p in params)  # float32, every weight of the run
    tokens = [int(t) for t in DATUM.tokens] + [5]
    np.testing.assert_allclose(trainer.score(handed, tokens), trainer.score(str(tmp_path / "stored"), tokens),
                               atol=1e-6)
    assert np.abs(np.asarray(trainer.score(handed, tokens)) - trainer.score(None, tokens)).max() > 1e-4
    # As a PEFT directory's contents (vLLM's samplers' form): the very files, in memory.
    peft_bytes, as_peft = trainer.sampler_tensors("handed", peft=True)
    stored = load_file(str(tmp_path / "stored" / "adapter_model.safetensors"))
    assert as_peft.state.keys() == stored.keys() and peft_bytes == sum(t.numel() * 4 for t in stored.values())
    for name, tensor in stored.items():
        np.testing.assert_array_equal(as_peft.state[name], tensor.numpy())
    assert as_peft.config == json.loads((tmp_path / "stored" / "adapter_config.json").read_text())
    read_back = LoraConfig.from_pretrained(str(tmp_path / "stored")).to_dict()  # what PEFT itself makes of it
    assert {k: as_peft.config[k] for k in ("r", "lora_alpha")} == {k: read_back[k] for k in ("r", "lora_alpha")}
    assert set(as_peft.config["target_modules"]) == set(read_back["target_modules"])
    np.testing.assert_allclose(trainer.score(as_peft, tokens), trainer.score(handed, tokens), atol=1e-7)
    trainer.unload("handed")
