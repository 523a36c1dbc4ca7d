"""A trainer split over two processes (``--trainer-shards 2``, gloo on CPU) through the real server and SDK: it trains
as the single trainer of the shared server does, each shard holds half the base model, a checkpoint crosses shard
counts both ways, and a shard that dies takes its group down and the runs come back from their checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from safetensors import safe_open
from tinker import types

from shims.losses import LOSSES
from tests.conftest import SERVER_ARGS
from tests.helpers import (
    ADAM,
    BASE_MODEL,
    checkpoint_dir,
    crash_the_trainer,
    forward_logprobs,
    machine_cpus,
    make_datum,
    one_request,
    poll_future,
    train,
    upload,
)
from tests.server import RunningServer, start_server

KEY = "tml-test-shards"
PROMPT = [11, 42, 77, 103, 250]
RUNS = ((4, 1), (8, 2), (2, 3))
"""(rank, seed) of the runs trained side by side: adapters of different ranks in one batch."""
ORDER = sorted(LOSSES)
"""Every built-in loss, one per run and step in turn: ``stable_reinforce`` (last) falls on run 0."""
STEPS = -(-len(ORDER) // len(RUNS))
SMALL_MEMORY = ("--activation-memory-mib", "64")
"""Each shard counts on 64 MiB for a pass's activations: about 1,000 tokens of the tiny model, checkpointed."""


def margin(logprobs, weights):
    """A custom loss (uploaded and run in the trainer): weighted NLL plus a penalty on its spread, with a metric."""
    return -(logprobs * weights).sum() + 0.1 * (logprobs * weights).var(), {"custom/mean_lp:mean": logprobs.mean()}


class Cluster:
    """The sharded server of this module, restarted by the tests that need another shard count."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.server: RunningServer | None = None
        self.flags: tuple = ()

    def start(self, shards: int, *extra: str) -> RunningServer:
        """The server with ``shards`` trainer shards and ``extra`` flags: the running one if it has them."""
        if self.server is not None and self.flags == (shards, *extra):
            return self.server
        self.stop()
        self.server = start_server(self.data_dir, *SERVER_ARGS, "--trainer-shards", str(shards), *extra, timeout=300)
        self.flags = (shards, *extra)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="module")
def cluster(model_cache, tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("sharded-data"))
    running.start(2)
    yield running
    running.stop()


def training_metrics(server: RunningServer) -> dict:
    return httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin, timeout=30).json()["training"][
        BASE_MODEL]


def rl_datum(rng: np.random.Generator, loss_fn: str, sequence=None) -> types.Datum:
    """A datum for ``loss_fn``: random tokens and inputs, or (``stable_reinforce``) the cookbook's layout of a
    sampled ``sequence``, its provenance pointing at the sampler's records."""
    if sequence is not None:
        tokens, n = PROMPT + sequence.tokens, len(PROMPT)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array([0] * (n - 1) + sequence.tokens, np.int64),
            "logprobs": np.array([0.0] * (n - 1) + sequence.logprobs, np.float32),
            "advantages": np.array([0.0] * (n - 1) + [0.5] * len(sequence.tokens), np.float32)})
        sid = sequence.sequence_id
        return datum.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=n),
                         types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=len(sequence.tokens) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n - 1),
                            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=len(sequence.tokens))])
    n = int(rng.integers(4, 60))
    tokens = rng.integers(0, 500, size=n + 1)
    inputs = {"target_tokens": tokens[1:].astype(np.int64)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = rng.uniform(0, 1, size=n).astype(np.float32)
    else:
        inputs |= {"logprobs": (-rng.exponential(size=n) - 5).astype(np.float32),
                   "advantages": rng.normal(size=n).astype(np.float32)}
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (rng.uniform(size=n) < 0.8).astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs)


def scenario(server: RunningServer) -> dict:
    """The same training on ``server``: three runs of ranks 4, 8 and 2 whose forward_backward calls reach the
    trainer together (mixed batches), every built-in loss in turn, a custom loss beside them, an optim step each after
    every round; what the server reports, and the weights each run ends with."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    runs = [service.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=seed).result()
            for rank, seed in RUNS]
    custom_run = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    custom = service.create_custom_loss(margin, {"logprobs": 1, "weights": 1}).result()
    # stable_reinforce reads what the sampler recorded: a rollout of the fresh run 0 (the same on both servers).
    sampler = runs[0].save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequence = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(
        max_tokens=6, temperature=1.0, seed=11, stop=[])).result().sequences[0]
    rng = np.random.default_rng(7)
    report: dict[str, list] = {"loss": [], "logprobs": [], "grad_norm": [], "custom": []}
    for step in range(STEPS):
        calls = []
        for i, run in enumerate(runs):
            loss_fn = ORDER[(step * len(runs) + i) % len(ORDER)]
            data = ([rl_datum(rng, loss_fn, sequence)] if loss_fn == "stable_reinforce" else
                    [rl_datum(rng, loss_fn) for _ in range(int(rng.integers(1, 4)))])
            calls.append(run.forward_backward(data, loss_fn))
        custom_data = [rl_datum(rng, "cross_entropy") for _ in range(3)]
        calls.append(custom_run.forward_backward_custom(custom_data, custom))
        results = [call.result() for call in calls]
        report["loss"] += [r.metrics["loss:sum"] for r in results]
        report["custom"].append(results[-1].metrics["custom/mean_lp:mean"])
        report["logprobs"] += [o["logprobs"].to_numpy() for r in results for o in r.loss_fn_outputs]
        steps = [run.optim_step(ADAM) for run in [*runs, custom_run]]
        report["grad_norm"] += [s.result().metrics["grad_norm"] for s in steps]
    report["weights"] = []
    for i, run in enumerate([*runs, custom_run]):
        path = run.save_weights_for_sampler(f"final-{i}").result().path
        with safe_open(str(checkpoint_dir(server.data_dir, path) / "adapter_model.safetensors"), "np") as f:
            report["weights"].append({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no iter
    service.close("success")
    return report


def test_every_loss_in_mixed_batches_trains_as_the_single_trainer_does(server, cluster):
    """Built-in losses, a custom one, adapters of ranks 2 to 8 in shared batches, optim steps of four runs: on two
    shards, the losses, metrics, logprobs, gradient norms and final weights equal the single trainer's (fp32)."""
    sharded = cluster.server
    before = training_metrics(sharded)
    single, split = scenario(server), scenario(sharded)
    after = training_metrics(sharded)
    assert after["requests"] - before["requests"] > after["batches"] - before["batches"], "no batch was shared"
    np.testing.assert_allclose(split["loss"], single["loss"], rtol=1e-5)
    np.testing.assert_allclose(split["custom"], single["custom"], rtol=1e-5)
    np.testing.assert_allclose(split["grad_norm"], single["grad_norm"], rtol=1e-5)
    for a, b in zip(split["logprobs"], single["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(split["weights"], single["weights"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(a[key], b[key], atol=1e-5, err_msg=key)
    assert min(split["grad_norm"]) > 0


def test_each_shard_holds_half_of_the_base_weights(cluster, tiny_model_dir):
    """Each shard's resident base weights (the memory its weights' storages hold, read inside the shard) are half of
    the checkpoint's tensors (read here from the file), between passes as at start; together, the whole."""
    with safe_open(str(tiny_model_dir / "model.safetensors"), "np") as f:
        whole = sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 - safe_open has no iterator
    client = tinker.ServiceClient(base_url=cluster.server.base_url, api_key=KEY).create_lora_training_client(
        base_model=BASE_MODEL, rank=4)
    train(client, make_datum([1, 2, 3], [4, 5]), 1)
    time.sleep(3)  # the pool asks the shards what they hold every 2 s
    shards = training_metrics(cluster.server)["shards"]
    assert [s["rank"] for s in shards] == [0, 1] and len({s["pid"] for s in shards}) == 2
    for shard in shards:
        assert 0.45 * whole < shard["base_bytes"] < 0.55 * whole, (shard, whole)
    assert sum(s["base_bytes"] for s in shards) == pytest.approx(whole, rel=0.02)
    # Both shards run on this machine, every pass together: each computes with half of its CPUs.
    assert [s["torch_threads"] for s in shards] == [max(1, machine_cpus() // 2)] * 2


def test_each_shard_holds_its_share_of_a_runs_optimizer_state_and_says_so(cluster):
    """What a run costs each shard, as the metric reads it in the shard: every shard holds the run's LoRA weights (4
    bytes a parameter; the step frees the gradients), and the AdamW moments (8 bytes a parameter on a single
    trainer) are split between the shards, each stepping its share of the parameters: 8 bytes a parameter on each of
    2 shards where a single trainer holds 12. The parameters are counted here from the run's export."""
    def shards() -> dict[int, dict]:
        time.sleep(3)  # the pool asks the shards what they hold every 2 s
        return {s["rank"]: s for s in training_metrics(cluster.server)["shards"]}

    before = shards()
    service = tinker.ServiceClient(base_url=cluster.server.base_url, api_key=KEY)
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=9).result()
    train(client, make_datum([1, 2, 3], [4, 5]), 1)
    exported = checkpoint_dir(cluster.server.data_dir, client.save_weights_external("state-bytes").result().path)
    with safe_open(str(exported / "adapter_model.safetensors"), "np") as f:
        parameters = sum(f.get_tensor(k).size for k in f.keys())  # noqa: SIM118 - safe_open has no iterator
    after = shards()
    grown = {rank: shard["adapter_bytes"] - before[rank]["adapter_bytes"] for rank, shard in after.items()}
    assert all(shard["runs"] == before[rank]["runs"] + 1 for rank, shard in after.items())
    assert sum(g - 4 * parameters for g in grown.values()) == pytest.approx(8 * parameters, rel=0.02), grown
    assert max(grown.values()) <= 0.7 * 12 * parameters, (grown, parameters)  # a single trainer: 12 per parameter
    service.close("success")
    assert all(s["adapter_bytes"] == before[s["rank"]]["adapter_bytes"] for s in shards().values())  # unloaded


def test_an_adapter_uploads_to_a_sharded_trainer(cluster):
    """The trainer's check of an upload runs on rank 0 alone; the checkpoint loads on every shard."""
    service = tinker.ServiceClient(base_url=cluster.server.base_url, api_key=KEY)
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()
    datum = make_datum([1, 2, 3, 4], [5, 6])
    train(client, datum, 2)
    exported = checkpoint_dir(cluster.server.data_dir, client.save_weights_external("to-upload").result().path)
    files = {name: (exported / name).read_bytes() for name in ("adapter_model.safetensors", "adapter_config.json")}
    finished = upload(cluster.server, KEY, files, {"rank": 4})
    assert finished.status_code == 200, finished.text
    loaded = service.create_training_client_from_state(finished.json()["tinker_path"]).result()
    np.testing.assert_allclose(forward_logprobs(loaded, datum), forward_logprobs(client, datum), atol=1e-6)
    service.close("success")


def two_tenants(server: RunningServer, seed: int) -> tuple[tinker.ServiceClient, tinker.TrainingClient,
                                                            tinker.TrainingClient]:
    """A victim tenant (its service, to close, and its run) and a run of this module's key beside it, seeds
    ``seed`` and ``seed + 1``."""
    victim_service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-shards-victim")
    victim = victim_service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=seed).result()
    odd = tinker.ServiceClient(base_url=server.base_url, api_key=KEY).create_lora_training_client(
        base_model=BASE_MODEL, rank=4, seed=seed + 1).result()
    return victim_service, victim, odd


def test_one_long_batch_of_one_token_datums_never_takes_the_group_down(cluster):
    """Issue 44, High 1: 2 × 2,000 tokens + 40,000 one-token datums, under --max-batch-tokens, were padded to a
    40,002 × 2,000 rectangle that no shard could allocate inside the shared forward, which is fatal to a sharded
    trainer: the group went down and other tenants lost acknowledged steps. Now a request of that many datums is
    refused before it reaches the trainer, naming --max-batch-datums, and one within it (20,000 one-token datums)
    runs packed, costing its real tokens. The victim's steps beside them all succeed and the group never restarts."""
    server = cluster.server
    restarts = training_metrics(server)["restarts"]
    victim_service, victim, odd = two_tenants(server, 21)
    rng = np.random.default_rng(5)
    long = [make_datum(rng.integers(0, 500, 1000).tolist(), rng.integers(0, 500, 1001).tolist()) for _ in range(2)]

    def one_token(count: int) -> list[types.Datum]:
        return [make_datum([int(a)], [int(b)]) for a, b in rng.integers(0, 500, (count, 2))]

    # Each sent as one request, as a client may (the SDK would split them into requests of 1,024 datums).
    refused = one_request(server.base_url, KEY, odd.model_id, 1, long + one_token(40_000))
    steps = [victim.forward_backward([rl_datum(rng, "cross_entropy")], "cross_entropy")]
    packed = one_request(server.base_url, KEY, odd.model_id, 2, long + one_token(20_000))
    steps.append(victim.forward_backward([rl_datum(rng, "cross_entropy")], "cross_entropy"))
    answer = poll_future(server.base_url, refused, KEY)
    assert answer["category"] == "user" and "--max-batch-datums 32768" in answer["error"], answer
    assert isinstance(poll_future(server.base_url, packed, KEY, deadline_s=300), bytes)
    for step in steps:
        assert np.isfinite(step.result().metrics["loss:sum"])
    assert victim.optim_step(ADAM).result().metrics["grad_norm"] > 0
    assert training_metrics(server)["restarts"] == restarts
    victim_service.close("success")


def test_a_dead_shard_takes_its_group_down_and_the_runs_come_back(cluster):
    """kill -9 one shard under a running request: that request fails as a crashed single trainer's does, the other
    shard is killed too (no orphan), the group starts again, and the runs come back from their checkpoints as after a
    crash of a single trainer (``tests.helpers.crash_the_trainer``)."""
    crash_the_trainer(cluster.server, KEY, lambda trainer: (trainer["shards"][1]["pid"], "its shard 1 of 2"))
    assert len(training_metrics(cluster.server)["shards"]) == 2


def test_a_checkpoint_crosses_shard_counts_both_ways(cluster):
    """Saved on two shards, resumed on one (the same data directory, the server restarted): the logprobs at the
    checkpoint and the next step equal the two-shard run's own; saved on one, resumed on two the same way."""
    datum = make_datum([5, 6, 7, 8, 9], [10, 11, 12])

    def resume(server: RunningServer, path: str) -> tuple[np.ndarray, float, str]:
        """Load ``path`` with its optimizer on ``server``: logprobs there, the loss of one more step, and a new
        checkpoint after it."""
        client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        run = client.create_training_client_from_state_with_optimizer(path).result()
        logprobs = forward_logprobs(run, datum)
        loss = train(run, datum, 1)[0]
        return logprobs, loss, run.save_state("next").result().path

    client = tinker.ServiceClient(base_url=cluster.server.base_url, api_key=KEY)
    run = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=9).result()
    train(run, datum, 2)
    two_shards = run.save_state("on-two").result().path
    on_two = resume(cluster.server, two_shards)

    on_one = resume(cluster.start(1), two_shards)
    assert len(training_metrics(cluster.server)["shards"]) == 1
    np.testing.assert_allclose(on_one[0], on_two[0], atol=1e-6)
    assert on_one[1] == pytest.approx(on_two[1], rel=1e-6)
    one_shard_next = forward_logprobs(
        tinker.ServiceClient(base_url=cluster.server.base_url, api_key=KEY).create_training_client_from_state(
            on_one[2]).result(), datum)

    back_on_two = resume(cluster.start(2, *SMALL_MEMORY), on_one[2])  # as the next test needs it: one start fewer
    assert len(training_metrics(cluster.server)["shards"]) == 2
    np.testing.assert_allclose(back_on_two[0], one_shard_next, atol=1e-6)


def test_a_pass_that_would_not_fit_on_one_shard_fails_its_request_alone(cluster):
    """Issue 44: a failure one shard meets inside a shared pass (out of memory) left the other shard waiting in a
    collective, and the group exited (``Shards.fatal``): other tenants lost acknowledged steps. Now each shard
    checks, before the pass, that its part's activations fit the memory it may use, and the shards agree: with
    64 MiB each, a request of 2,000 + 200 tokens (the 2,000 on one shard, which could not hold them; the other could)
    is refused with a 4xx naming the limit, the other tenant's step in the same moment runs, the group never
    restarts, and the same run trains on with a request that fits."""
    server = cluster.start(2, *SMALL_MEMORY)
    restarts = training_metrics(server)["restarts"]
    victim_service, victim, odd = two_tenants(server, 31)
    rng = np.random.default_rng(9)
    big = [make_datum(rng.integers(0, 500, 1).tolist(), rng.integers(0, 500, n).tolist()) for n in (2000, 200)]
    refused = one_request(server.base_url, KEY, odd.model_id, 1, big)
    step = victim.forward_backward([rl_datum(rng, "cross_entropy") for _ in range(3)], "cross_entropy")
    answer = poll_future(server.base_url, refused, KEY)
    assert answer["category"] == "user", answer
    assert "2000 tokens" in answer["error"] and "--activation-memory-mib" in answer["error"], answer
    assert "trainer shard 0" in answer["error"], answer
    assert np.isfinite(step.result().metrics["loss:sum"])
    assert victim.optim_step(ADAM).result().metrics["grad_norm"] > 0
    fits = one_request(server.base_url, KEY, odd.model_id, 2, big[1:])
    assert isinstance(poll_future(server.base_url, fits, KEY), bytes)
    assert training_metrics(server)["restarts"] == restarts
    victim_service.close("success")
