"""Expert parallelism (``adapters.lora.expert_parallel``, ``adapters.trainer.parallelize``) on a mixture of experts
with many experts, as the families hosted Tinker trains have them (Qwen3-30B-A3B: 128, top-8; here 32, top-4, tiny
widths): each shard holds its share of every MoE layer's experts — base weights, LoRA pairs, their gradients and
optimizer state — and computes the (token, expert) rows routed to them.

A training run crosses shard counts through its checkpoints, 1 → 4 → 2 → 1 (one sharded process), training a mixed
batch on each beside two other runs (one with a custom loss); every output, metric and the final checkpoint (weights
and optimizer state) equal the single trainer doing the same steps (1e-5). And what a run holds per shard (the metric
``/api/v1/metrics`` reports: ``AdapterTable.state_bytes``) is at most 0.6× what the single trainer holds for it, at a
step's peak (gradients held) and between steps. These shards run as spawned processes over gloo, no Ray and no
server; the last tests run a server with its trainer on 2 shards, through the SDK."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors import safe_open

from tests.conftest import SERVER_ARGS
from tests.helpers import checkpoint_dir, crash_the_trainer, forward_logprobs, make_datum, spawned_shards, train
from tests.server import start_server

KEY = "tml-test-experts"

MANY_EXPERTS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                "intermediate_size": 128, "vocab_size": 512}
"""A Qwen3-MoE whose adapter is mostly experts' (as a real one's is: 98% for Qwen3-30B-A3B at any rank)."""


@pytest.fixture(scope="module")
def moe_dir(model_cache, tmp_path_factory) -> str:
    """The model, with the tiny model's tokenizer beside it for the server's sampler."""
    from transformers import Qwen3MoeConfig

    from adapters.models.tiny import save_random_model

    config = Qwen3MoeConfig(**MANY_EXPERTS, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    return str(save_random_model(config, tmp_path_factory.mktemp("many-experts")))


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory):
    """The server with that model alone, its trainer on 2 shards (expert parallel), the transformers sampler."""
    server = start_server(tmp_path_factory.mktemp("expert-parallel"), *SERVER_ARGS, "--base-model", moe_dir,
                          "--trainer-shards", "2", "--sampler-backend", "transformers", timeout=300)
    yield server
    server.stop()


def stage(trainer, index: int, load: str | None, save: str) -> dict:
    """Run "a" (rank 16, every weight group; from checkpoint ``load`` with its optimizer, else fresh) and fresh runs
    "b" (rank 8, attention and experts) and "c" (rank 4, experts and head) train one mixed batch (cross-entropy,
    importance sampling and a custom loss, datums of varied lengths) and step; "a" is saved to ``save``. Returns the outcomes and run "a"'s adapter bytes on every
    shard, at the step's peak and after it."""
    from adapters.trainer.interface import AdamHyper, LoraSpec, OptimRequest, StepRequest
    from tests.test_lora_exact import _datum
    from tests.test_trainer_custom_loss import compiled, datum, weighted

    rng = np.random.default_rng(index)
    if load is None:
        trainer.create("a", LoraSpec(rank=16, seed=1))
    else:
        trainer.load_state("a", load, with_optimizer=True)
    trainer.create("b", LoraSpec(rank=8, seed=2 + index, train_unembed=False))
    trainer.create("c", LoraSpec(rank=4, seed=5 + index, train_attn=False))
    requests = [StepRequest("a", [_datum(rng, int(n), "cross_entropy") for n in rng.integers(5, 60, 3)],
                            "cross_entropy", {}, False),
                StepRequest("b", [_datum(rng, int(n), "importance_sampling") for n in rng.integers(5, 60, 2)],
                            "importance_sampling", {}, False),
                StepRequest("c", [datum(rng, int(n), 0.5) for n in rng.integers(5, 40, 2)], "custom", {}, False,
                            custom_loss=compiled(weighted))]
    outcomes = trainer.forward_backward_batch(requests)
    peak = trainer.adapters.state_bytes("a")
    # At LoRA's usual learning rates: Adam's step divides by the gradient's own scale, so at 1e-2 an element whose
    # gradient is ~0 moves by rounding alone (1.4e-5 between 4 shards and 1, once in 400 tensors).
    stepped = trainer.optim_steps([OptimRequest(m, AdamHyper(learning_rate=1e-3)) for m in ("a", "b", "c")])
    after = trainer.adapters.state_bytes("a")
    trainer.save_state("a", save)
    for model_id in ("a", "b", "c"):
        trainer.unload(model_id)
    return {"outcomes": outcomes, "stepped": stepped, "bytes": trainer.shards.everywhere((peak, after))}


def _shard(rank: int, world: int, address: str, directory: str, index: int, load: str | None, save: str,
           results) -> None:
    from adapters.trainer.actor import MultiLoRATrainer
    from adapters.trainer.interface import ShardSpec

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trainer = MultiLoRATrainer(directory, shard=ShardSpec(rank, world, address))
    outcome = stage(trainer, index, load, save)
    if rank == 0:
        results.put((trainer.facts.experts, outcome))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def sharded(world: int, directory: str, index: int, load: str | None, save: str) -> tuple[str, dict]:
    """``stage`` on ``world`` spawned shards: what rank 0 holds of the experts, in words, and its outcome."""
    return spawned_shards(_shard, world, (directory, index, load, save), 1, 300)[0]


def _failing_gather(rank: int, world: int, address: str, directory: str, out: str, results) -> None:
    """A save whose gather fails on rank 0 after the exchange (as unpacking every shard's part may, out of memory):
    every shard's call fails alike, and the group trains on."""
    from adapters.trainer.actor import MultiLoRATrainer
    from adapters.trainer.interface import LoraSpec, ShardSpec, StepRequest
    from tests.test_lora_exact import _datum

    torch.set_num_threads(1)
    trainer = MultiLoRATrainer(directory, shard=ShardSpec(rank, world, address))
    trainer.create("a", LoraSpec(rank=4, seed=1))
    if rank == 0:
        gather = trainer.shards.gather

        def unpacked_out_of_memory(value):
            gather(value)
            raise MemoryError("unpacking the shards' parts")

        trainer.shards.gather = unpacked_out_of_memory
    outcomes = []
    for save in (trainer.save_for_sampler, trainer.save_state):
        try:
            save("a", out)
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001 - the outcome compared
            outcomes.append(f"{type(exc).__name__}: {exc}")
    vars(trainer.shards).pop("gather", None)  # the pass's own gather (its answers on rank 0) as it is
    step = trainer.forward_backward_batch([StepRequest("a", [_datum(np.random.default_rng(0), 9, "cross_entropy")],
                                                       "cross_entropy", {}, False)])[0]
    results.put((rank, outcomes, float(step.metrics["loss:sum"]) if rank == 0 else None))  # rank 0 answers
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def test_a_save_whose_gather_fails_on_rank_0_fails_on_every_shard_and_the_group_goes_on(moe_dir, tmp_path):
    found = sorted(spawned_shards(_failing_gather, 2, (moe_dir, str(tmp_path / "never")), 2, 300))
    for _, outcomes, _ in found:
        assert outcomes == ["RuntimeError: unpacking the shards' parts"] * 2, outcomes
    assert np.isfinite(found[0][2])
    assert not (tmp_path / "never").exists()


def assert_same(split: dict, plain: dict) -> None:
    for got, want in zip(split["outcomes"], plain["outcomes"], strict=True):
        assert got.metrics == pytest.approx(want.metrics, rel=1e-5, abs=1e-6)
        for x, y in zip(got.outputs, want.outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    for got, want in zip(split["stepped"], plain["stepped"], strict=True):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5) and want["grad_norm"] > 0


def assert_same_checkpoint(split: Path, plain: Path) -> None:
    from safetensors.torch import load_file

    ours, theirs = load_file(split / "adapter_model.safetensors"), load_file(plain / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and any(".experts.31." in key for key in ours)
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=0, atol=1e-5, msg=key)
    ours, theirs = (torch.load(d / "optimizer.pt", weights_only=True) for d in (split, plain))
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-5, atol=1e-7)


def test_a_run_crosses_shard_counts_and_each_shard_holds_its_experts_share(moe_dir, tmp_path):
    from adapters.trainer.actor import MultiLoRATrainer

    plain_trainer = MultiLoRATrainer(moe_dir)
    plain = [stage(plain_trainer, 0, None, str(tmp_path / "plain-0"))]
    plain += [stage(plain_trainer, i, str(tmp_path / f"plain-{i - 1}"), str(tmp_path / f"plain-{i}"))
              for i in (1, 2, 3)]

    held4, on4 = sharded(4, moe_dir, 1, str(tmp_path / "plain-0"), str(tmp_path / "four-1"))
    assert held4 == "experts 0–7 of 32 in each of 2 MoE layers, with their LoRA pairs"
    assert_same(on4, plain[1])
    assert_same_checkpoint(tmp_path / "four-1", tmp_path / "plain-1")
    held2, on2 = sharded(2, moe_dir, 2, str(tmp_path / "four-1"), str(tmp_path / "two-2"))
    assert held2 == "experts 0–15 of 32 in each of 2 MoE layers, with their LoRA pairs"
    assert_same(on2, plain[2])
    assert_same_checkpoint(tmp_path / "two-2", tmp_path / "plain-2")
    # One shard of one runs the expert-parallel code too (how bench.gpu_smoke checks it on a single GPU).
    held1, on1 = sharded(1, moe_dir, 3, str(tmp_path / "two-2"), str(tmp_path / "one-3"))
    assert held1 == "experts 0–31 of 32 in each of 2 MoE layers, with their LoRA pairs"
    assert_same(on1, plain[3])
    assert_same_checkpoint(tmp_path / "one-3", tmp_path / "plain-3")

    # What run "a" holds on each shard against the single trainer: at the step's peak (weights, gradients, moments)
    # and after it (the gradients freed).
    (single,) = plain[2]["bytes"]
    for on, most in ((on2, 0.6), (on4, 0.35)):
        for moment in (0, 1):
            shares = [held[moment] for held in on["bytes"]]
            assert max(shares) <= most * single[moment], (moment, shares, single)


def test_the_gpu_smoke_runs_the_sharded_and_expert_parallel_checks_it_will_run_on_a_gpu(tmp_path):
    """``bench.gpu_smoke``'s sharded checks (one shard of one, beside the plain trainer: a dense model with a tied
    head, and a mixture of experts through the expert-parallel path) pass here on the CPU, so that a GPU session's
    first minutes are not spent on a check that fails everywhere (the tied head failed FSDP2's first pass at world
    size 1 until it was kept in the embedding's unit)."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from bench.gpu_smoke import build_model, sharded; "
            f"sys.exit(len(sharded(build_model(Path({str(tmp_path)!r}) / 'model'), 'cpu')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS [sharded trainer] world size 1:" in done.stdout
    assert "expert parallel (experts 0–15 of 16" in done.stdout, done.stdout


def shards(server) -> list[dict]:
    time.sleep(3)  # the pool asks the shards what they hold every 2 s
    answer = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin, timeout=30).json()
    (trainer,) = answer["training"].values()
    return sorted(trainer["shards"], key=lambda shard: shard["rank"])


def test_through_the_server_each_shard_holds_its_experts_and_a_run_costs_it_under_0_6x(moe_server, moe_dir):
    """Through the SDK and ``/api/v1/metrics``: each shard says which experts it holds, a rank-16 run grows each
    shard's adapter state by at most 0.6× the single trainer's 12 bytes a parameter after a step (its weights and
    AdamW moments; ``tests/test_sharded_trainer.py`` measures the 12), and the run's sampler weights, gathered from
    both shards, sample as the trainer scores."""
    before = shards(moe_server)
    assert [s["experts"] for s in before] == [
        f"experts {first}–{first + 15} of 32 in each of 2 MoE layers, with their LoRA pairs" for first in (0, 16)]
    service = tinker.ServiceClient(base_url=moe_server.base_url, api_key=KEY)
    run = service.create_lora_training_client(base_model=moe_dir, rank=16, seed=3).result()
    datum = make_datum([1, 7, 30, 2, 99, 140, 5, 8], [3, 5, 260, 11, 8, 9])
    train(run, datum, 2)
    exported = checkpoint_dir(moe_server.data_dir, run.save_weights_external("experts").result().path)
    with safe_open(str(exported / "adapter_model.safetensors"), "np") as f:
        parameters = sum(f.get_tensor(k).size for k in f.keys())  # noqa: SIM118 - safe_open has no iterator
    grown = [after["adapter_bytes"] - then["adapter_bytes"] for after, then in zip(shards(moe_server), before,
                                                                                   strict=True)]
    assert max(grown) <= 0.6 * 12 * parameters, (grown, parameters)
    path = run.save_weights_for_sampler("experts-sampler").result().path
    tokens = datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
    scored = run.create_sampling_client(model_path=path).compute_logprobs(
        tinker.types.ModelInput.from_ints(tokens)).result()
    np.testing.assert_allclose(np.asarray(scored[1:], dtype=np.float64), forward_logprobs(run, datum), atol=1e-4)
    service.close("success")


def test_a_dead_shard_of_an_expert_parallel_trainer_takes_its_group_down_and_the_runs_come_back(moe_server,
                                                                                                moe_dir):
    """kill -9 one shard under a running request: as on a dense model (``tests.helpers.crash_the_trainer``)."""
    crash_the_trainer(moe_server, KEY, lambda trainer: (trainer["shards"][1]["pid"], "its shard 1 of 2"),
                      base_model=moe_dir)
