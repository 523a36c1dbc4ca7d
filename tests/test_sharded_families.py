"""The sharded trainer on every family hosted Tinker trains, in-process: two processes (gloo) each holding half of a
tiny model of the family run the same mixed-adapter script as one plain trainer — every built-in loss, adapters of
three ranks on different weight groups, a forward-only request, activation checkpointing, AdamW and Dimuon steps,
scoring — and every output, metric, gradient norm and final weight equals the plain trainer's (fp32).

No Ray and no server here (``tests/test_sharded_trainer.py`` runs the shards through both): this is the numerics of
``adapters.trainer.shards`` and ``adapters.trainer.forward`` on mixtures of experts, MLA, linear attention, Mamba and a
vision-language checkpoint, where a sharded weight or a shard's share of a batch is most easily got wrong."""

from __future__ import annotations

import operator
import os
from pathlib import Path

import numpy as np
import pytest

from adapters.trainer.options import TrainerOptions
from tests.families import FAMILIES, family_dir
from tests.helpers import spawned_shards

SHARDED = ("llama3", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5_moe_vl", "nemotron_h")
"""Tied and untied heads, experts of every layout, MLA, Gated DeltaNet with a vision tower, Mamba-2 (qwen3 and the
text-only qwen3_5_moe are their neighbours' layouts)."""
UNTIED = "qwen3"
"""A dense model with its own head: the batches of ``edge_script`` run on it."""
RECOMPUTING = TrainerOptions(activation_checkpointing_tokens=64)
"""Batches of these scripts recompute their layers' activations in backward (most are longer than 64 tokens)."""


def script(trainer) -> tuple[list, list[float], dict]:
    """Three rounds of mixed batches over four runs (ranks 8, 2 and 4; all weights, attention only, MLP and head;
    one stepped by Dimuon), every loss in turn, one run forward-only in the second round; each round's optim steps;
    then a score. Returns the outcomes, the score and every run's final parameters."""
    from adapters.samplers.interface import joined
    from adapters.trainer.interface import AdamHyper, DimuonHyper, LoraSpec, OptimRequest, StepRequest
    from adapters.trainer.parallelize import whole_tensors
    from shims.losses import LOSSES
    from tests.test_lora_exact import _datum

    rng = np.random.default_rng(0)
    specs = {"a": LoraSpec(rank=8, seed=1), "b": LoraSpec(rank=2, seed=2, train_mlp=False, train_unembed=False),
             "c": LoraSpec(rank=4, seed=3, train_attn=False), "d": LoraSpec(rank=4, seed=4, optimizer="dimuon")}
    for model_id, spec in specs.items():
        trainer.create(model_id, spec)
    losses = sorted(LOSSES)
    rounds = []
    for step in range(3):
        requests = []
        for j, model_id in enumerate(specs):
            loss_fn = losses[(step * len(specs) + j) % len(losses)]
            data = [_datum(rng, int(rng.integers(3, 40)), loss_fn) for _ in range(int(rng.integers(1, 4)))]
            requests.append(StepRequest(model_id, data, loss_fn, {}, forward_only=model_id == "c" and step == 1))
        outcomes = trainer.forward_backward_batch(requests)
        stepped = trainer.optim_steps([OptimRequest(m, DimuonHyper(learning_rate=1e-2) if m == "d" else
                                                    AdamHyper(learning_rate=1e-2)) for m in specs])
        rounds.append((outcomes, stepped))
    score = trainer.score(None, [1, 2, 3, 4, 5, 6])
    # Every expert's pairs, gathered from the shards that hold them (rank 0's; None on the others).
    weights = {m: whole_tensors(trainer.model, trainer.adapters[m].name, trainer.shards) for m in specs}
    # The hand-off's parts in both forms, each shard's own (gathered here only to be compared), and their bytes.
    handed = [trainer.sampler_tensors("a", peft) for peft in (False, True)]
    parts = trainer.shards.gather([part for _, part in handed])
    return rounds, score, weights, trainer.shards.everywhere(trainer.adapters.state_bytes()), (
        [nbytes for nbytes, _ in handed], parts and [joined(list(form)) for form in zip(*parts, strict=True)])


def floor_divided(logprobs):
    return operator.floordiv(logprobs, logprobs).sum(), {}  # runs forward; its backward raises


def isolation_script(trainer, hostile: bool) -> tuple[list, list]:
    """Two honest runs in one batch, with (``hostile``) two more beside them, each with two datums that go to
    different shards: a custom loss whose backward raises, and a loss that is not finite on one datum only. Returns
    the outcomes and the honest runs' optim steps."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    from adapters.trainer.interface import AdamHyper, LoraSpec, OptimRequest, StepRequest
    from shims.custom_loss.graph import CustomLossLimits, compile_custom_loss
    from tests.test_lora_exact import _datum

    rng = np.random.default_rng(5)
    for model_id in ("a", "b", "bad", "nan"):
        trainer.create(model_id, LoraSpec(rank=4, seed=len(model_id)))
    handle = trace_loss(floor_divided, {"logprobs": 1}, "s")
    custom = compile_custom_loss(handle.name, handle.inputs, encode_graph(handle).nodes, CustomLossLimits())
    overflow = [_datum(rng, 30, "importance_sampling") for _ in range(2)]
    overflow[1].loss_fn_inputs["logprobs"][:] = -1e4  # the ratio to this sampler overflows: an infinite loss
    requests = [StepRequest("a", [_datum(rng, 20, "cross_entropy") for _ in range(3)], "cross_entropy", {}, False),
                StepRequest("bad", [_datum(rng, 9, "cross_entropy") for _ in range(2)], "custom", {}, False,
                            custom_loss=custom),
                StepRequest("nan", overflow, "importance_sampling", {}, False),
                StepRequest("b", [_datum(rng, 11, "cross_entropy") for _ in range(2)], "cross_entropy", {}, False)]
    outcomes = trainer.forward_backward_batch(requests if hostile else [requests[0], requests[3]])
    return outcomes, trainer.optim_steps([OptimRequest(m, AdamHyper(learning_rate=1e-2)) for m in ("a", "b")])


def edge_script(trainer, checkpoint: str) -> list:
    """Batches that leave a shard out of the loss (the untied head's weights are gathered and freed around it): one
    datum (the other shard idle), a shard holding only a forward-only request's datum, a forward-only datum first on a
    shard, a batch whose only training request fails; then repeated scores, and a checkpoint one shard cannot read
    (``checkpoint`` is its directory, or a path that does not exist). Returns every outcome, in order."""
    from adapters.trainer.interface import AdamHyper, LoraSpec, OptimRequest, StepRequest
    from tests.test_lora_exact import _datum

    rng = np.random.default_rng(9)
    trainer.create("a", LoraSpec(rank=4, seed=1))
    trainer.create("b", LoraSpec(rank=4, seed=2))
    overflow = [_datum(rng, 30, "importance_sampling") for _ in range(2)]
    overflow[1].loss_fn_inputs["logprobs"][:] = -1e4
    batches = [[StepRequest("a", [_datum(rng, 12, "cross_entropy")], "cross_entropy", {}, False)],
               [StepRequest("a", [_datum(rng, 30, "cross_entropy")], "cross_entropy", {}, False),
                StepRequest("b", [_datum(rng, 12, "cross_entropy")], "cross_entropy", {}, True)],
               [StepRequest("b", [_datum(rng, 20, "cross_entropy")], "cross_entropy", {}, True),
                StepRequest("a", [_datum(rng, n, "cross_entropy") for n in (19, 18, 5)], "cross_entropy", {}, False)],
               [StepRequest("a", overflow, "importance_sampling", {}, False)],
               [StepRequest("a", [_datum(rng, 12, "cross_entropy") for _ in range(3)], "cross_entropy", {}, False)]]
    outcomes: list = []
    for batch in batches:
        outcomes.append(trainer.forward_backward_batch(batch))
        outcomes.append(trainer.optim_steps([OptimRequest("a", AdamHyper(learning_rate=1e-2))]))
    outcomes += [trainer.score(None, [5, 4, 3, 2, 1]) for _ in range(3)]
    try:
        trainer.load_state("b", checkpoint, with_optimizer=True)
        outcomes.append("loaded")
    except Exception as exc:  # noqa: BLE001 - the outcome compared
        outcomes.append(exc)
    outcomes.append(trainer.forward_backward_batch(batches[-1]))
    return outcomes


def positions(kwargs: dict) -> tuple[int, int]:
    """(positions computed, real tokens among them) of one decoder forward: a padded batch's mask says which are."""
    embeds, mask = kwargs["inputs_embeds"], kwargs.get("attention_mask")
    computed = embeds.shape[0] * embeds.shape[1]
    return computed, computed if mask is None else int(mask.sum())


def _shard(rank: int, world: int, address: str, directories: list[str], checkpoint: str, results) -> None:
    import torch

    from adapters.trainer.actor import MultiLoRATrainer
    from adapters.trainer.interface import ShardSpec

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for directory in directories:
        trainer = MultiLoRATrainer(directory, RECOMPUTING, shard=ShardSpec(rank, world, address))
        forwards: list[tuple[int, int]] = []
        hook = trainer.passes.base.get_decoder().register_forward_pre_hook(
            lambda _module, _args, kwargs, forwards=forwards: forwards.append(positions(kwargs)), with_kwargs=True)
        outcome = script(trainer)
        hook.remove()
        if rank == 0:
            results.put((directory, (*outcome, forwards)))
    isolated = isolation_script(MultiLoRATrainer(directories[0], shard=ShardSpec(rank, world, address)), True)
    if rank == 0:
        results.put(("isolation", isolated))
    import torch.distributed as dist

    edges = edge_script(MultiLoRATrainer(str(family_dir(UNTIED)), RECOMPUTING,
                                         shard=ShardSpec(rank, world, address)),
                        checkpoint if rank == 0 else checkpoint + "-not-on-this-node")
    if rank == 0:
        results.put(("edges", edges))

    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def edge_checkpoint(model_cache, tmp_path_factory) -> str:
    """A training checkpoint of run "b" as ``edge_script`` creates it, for its load."""
    from adapters.trainer.actor import MultiLoRATrainer
    from adapters.trainer.interface import LoraSpec

    trainer = MultiLoRATrainer(str(family_dir(UNTIED)))
    trainer.create("b", LoraSpec(rank=4, seed=2))
    directory = str(tmp_path_factory.mktemp("edge") / "b")
    trainer.save_state("b", directory)
    return directory


@pytest.fixture(scope="module")
def sharded_runs(model_cache, edge_checkpoint) -> dict[str, tuple]:
    """The scripts on two shards, for every family of ``SHARDED``, in two spawned processes."""
    directories = [str(family_dir(name)) for name in SHARDED]
    found = spawned_shards(_shard, 2, (directories, edge_checkpoint), len(directories) + 2, 600)
    return {Path(directory).name: outcome for directory, outcome in found}


@pytest.mark.parametrize("family", SHARDED)
def test_two_shards_train_every_family_as_one_trainer(sharded_runs, family):
    """Every loss in mixed batches, on two shards as on one trainer (1e-5), computing no more than 10% padding."""
    from adapters.trainer.actor import MultiLoRATrainer
    from shims.errors import UserError

    assert family in FAMILIES
    rounds, score, weights, (held,), (sizes, handed) = script(MultiLoRATrainer(str(family_dir(family)), RECOMPUTING))
    split_rounds, split_score, split_weights, split_held, (split_sizes, split_handed), forwards = sharded_runs[family]
    # What each shard holds of the runs' adapter state: at most 0.7× the single trainer's (the optimizer state split;
    # the experts' pairs held once, by their shard, on a mixture of experts: 0.55–0.63× on these 4-expert models).
    assert max(split_held) <= 0.7 * held, (split_held, held)
    # A recurrent family runs padded length buckets on each shard, as on one trainer: padding stays within 10% of
    # the real tokens (it ran one forward per shard padded to its longest datum: ~2x the real tokens here).
    computed, real = (sum(column) for column in zip(*forwards, strict=True))
    assert computed <= 1.1 * real, (family, computed, real)
    for (outcomes, stepped), (split_outcomes, split_stepped) in zip(rounds, split_rounds, strict=True):
        for plain, split in zip(outcomes, split_outcomes, strict=True):
            assert not isinstance(plain, UserError | Exception) and not isinstance(split, UserError | Exception)
            assert plain.metrics.keys() == split.metrics.keys()
            for key, value in plain.metrics.items():
                assert split.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            for x, y in zip(plain.outputs, split.outputs, strict=True):
                np.testing.assert_allclose(y["logprobs"], x["logprobs"], atol=1e-5)
        for plain, split in zip(stepped, split_stepped, strict=True):  # 0 for the run that only ran forward
            assert split["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
        assert sum(plain["grad_norm"] > 0 for plain in stepped) >= 2
    np.testing.assert_allclose(split_score, score, atol=1e-5)
    for model_id, pairs in weights.items():
        assert pairs.keys() == split_weights[model_id].keys()
        for key, (a, b) in pairs.items():
            np.testing.assert_allclose(split_weights[model_id][key][0], a, atol=1e-5)
            np.testing.assert_allclose(split_weights[model_id][key][1], b, atol=1e-5)
    # Handed over in memory, each shard its own part, with no gather: joined, the whole adapter in both forms, and
    # the bytes each shard reports are the whole adapter's.
    assert split_sizes == sizes
    by_slots, split_by_slots = handed[0], split_handed[0]
    assert split_by_slots.pairs.keys() == by_slots.pairs.keys() and split_by_slots.scaling == by_slots.scaling
    for key, (a, b) in by_slots.pairs.items():
        np.testing.assert_allclose(split_by_slots.pairs[key][0], a, atol=1e-5)
        np.testing.assert_allclose(split_by_slots.pairs[key][1], b, atol=1e-5)
    as_peft, split_as_peft = handed[1], split_handed[1]
    assert split_as_peft.state.keys() == as_peft.state.keys() and split_as_peft.config == as_peft.config
    for name, tensor in as_peft.state.items():
        np.testing.assert_allclose(split_as_peft.state[name], tensor, atol=1e-5)


def test_a_request_that_fails_on_one_shard_fails_alone(sharded_runs, model_cache):
    """Beside two honest runs, a custom loss whose backward raises and a loss that overflows on one of its two datums
    (each datum on another shard): each fails alone as a user error, on every shard alike (the next batch runs), and
    the honest runs get exactly what they get without them."""
    from adapters.trainer.actor import MultiLoRATrainer
    from shims.errors import UserError

    directory = str(family_dir(SHARDED[0]))
    outcomes, stepped = sharded_runs["isolation"]
    alone, alone_stepped = isolation_script(MultiLoRATrainer(directory), False)
    plain, plain_stepped = isolation_script(MultiLoRATrainer(directory), True)
    for got in (outcomes, plain):  # sharded, and the plain trainer: the same errors
        assert isinstance(got[1], UserError) and "custom loss 'floor_divided' failed: RuntimeError" in str(got[1])
        assert isinstance(got[2], UserError) and "the loss is not finite" in str(got[2])
    for got, want in ((outcomes[0], alone[0]), (outcomes[3], alone[1])):
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
        for x, y in zip(got.outputs, want.outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    for got, plain_got, want in zip(stepped, plain_stepped, alone_stepped, strict=True):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5) and want["grad_norm"] > 0
        assert plain_got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_batches_that_leave_a_shard_out_of_the_loss_run_as_on_one_trainer(sharded_runs, edge_checkpoint):
    """A shard with no datum, or only forward-only ones, or a forward-only one first, and a batch that trains nothing:
    on a model whose head is its own FSDP2 unit, every one runs and equals the plain trainer, as do repeated scores;
    a checkpoint one shard cannot read fails the load on every shard, changes nothing, and the next batch runs."""
    from adapters.trainer.actor import MultiLoRATrainer
    from shims.errors import UserError

    plain = edge_script(MultiLoRATrainer(str(family_dir(UNTIED)), RECOMPUTING), edge_checkpoint)
    split = sharded_runs["edges"]
    assert plain[-2] == "loaded"
    assert isinstance(split[-2], UserError) and "could not be read by every trainer shard" in str(split[-2])
    plain = plain[:-2] + plain[-1:]
    split = split[:-2] + split[-1:]
    for got, want in zip(split, plain, strict=True):
        if isinstance(want, list) and want and isinstance(want[0], float):  # a score
            np.testing.assert_allclose(got, want, atol=1e-5)
            continue
        for a, b in zip(got, want, strict=True):
            assert type(a) is type(b), (a, b)
            if isinstance(b, dict):  # an optim step
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            elif not isinstance(b, Exception):
                assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
