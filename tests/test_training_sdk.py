"""The tinker SDK, unmodified, trains, saves and resumes LoRA adapters on the real server."""

from __future__ import annotations

import itertools

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.helpers import (
    ADAM,
    BASE_MODEL,
    MAIN_KEY,
    checkpoint_dir,
    datum_arrays,
    expect_user_error,
    forward_logprobs,
    make_datum,
    one_request,
    poll_future,
    reference_logprobs,
    reference_peft_model,
    train,
)

PROMPT, COMPLETION = [11, 42, 77, 103, 250], [301, 17, 96]


@pytest.fixture(scope="module")
def datum() -> types.Datum:
    return make_datum(PROMPT, COMPLETION)


def test_capabilities_info_tokenizer_and_loss_falls(service_client, server):
    caps = tinker.RestClient(base_url=server.base_url, api_key=MAIN_KEY).get_server_capabilities().result()
    model = next(m for m in caps.supported_models if m.model_name == BASE_MODEL)
    assert model.max_context_length == 2048 and model.trainable

    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    info = client.get_info()
    assert info.model_data.model_name == BASE_MODEL and info.model_data.arch == "Qwen3ForCausalLM"
    assert info.is_lora and info.lora_rank == 8
    # By name, offline (HF_HUB_OFFLINE=1 for the whole session): the server installed the tiny model into the Hugging
    # Face cache under its name, as a downloaded model would be.
    assert info.model_data.tokenizer_id == BASE_MODEL
    tokenizer = client.get_tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    completion = tokenizer.encode(" Paris.") + [tokenizer.eos_token_id]
    assert tokenizer.decode(prompt + completion[:-1]) == "The capital of France is Paris."
    datum = make_datum(prompt, completion)

    losses = []
    for _ in range(5):
        fb = client.forward_backward([datum], "cross_entropy")
        opt = client.optim_step(ADAM)
        out = fb.result()
        opt.result()
        _, _, weights = datum_arrays(datum)
        logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
        # The reported loss is the weighted sum of the returned logprobs, as Tinker defines cross_entropy.
        assert out.metrics["loss:sum"] == pytest.approx(-(logprobs * weights).sum(), rel=1e-5)
        losses.append(out.metrics["loss:sum"])
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses


def test_forward_matches_transformers_peft_reference(service_client, server, tiny_model_dir, datum):
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    train(client, datum, 3)
    path = client.save_weights_for_sampler("reference-check").result().path
    assert path.startswith("tinker://") and "/sampler_weights/reference-check" in path
    adapter_dir = checkpoint_dir(server.data_dir, path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}

    served = forward_logprobs(client, datum)
    model = reference_peft_model(tiny_model_dir, adapter_dir)
    with torch.no_grad():
        expected = reference_logprobs(model, datum).numpy()
        with model.disable_adapter():
            base_only = reference_logprobs(model, datum).numpy()
    np.testing.assert_allclose(served, expected, atol=1e-5, rtol=0)
    assert np.abs(served - base_only).max() > 1e-3, "training must have moved the adapter"


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_resume_from_state_is_exact(service_client, server, tiny_model_dir, datum):
    run_a = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=11).result()
    train(run_a, datum, 4)
    final_a = forward_logprobs(run_a, datum)

    run_b = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=11).result()
    train(run_b, datum, 2)
    state = run_b.save_state("after-2").result().path
    assert "/weights/after-2" in state
    at_save = forward_logprobs(run_b, datum)

    # With the optimizer state: the continuation is exactly run A.
    resumed = service_client.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.model_id != run_b.model_id
    train(resumed, datum, 2)
    np.testing.assert_allclose(forward_logprobs(resumed, datum), final_a, atol=1e-6, rtol=0)

    # load_state_with_optimizer onto an existing client does the same.
    reloaded = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=99).result()
    reloaded.load_state_with_optimizer(state).result()
    train(reloaded, datum, 2)
    np.testing.assert_allclose(forward_logprobs(reloaded, datum), final_a, atol=1e-6, rtol=0)

    # A client that has made requests cannot load, as on hosted Tinker; the refusal takes its turn and the run goes on.
    with pytest.raises(tinker.RequestFailedError, match="LoadWeights is not permitted with seq_id 7") as refused:
        reloaded.load_state(state).result()  # after its load, 2 × (forward_backward, optim_step) and a forward
    assert refused.value.category == types.RequestErrorCategory.User
    train(reloaded, datum, 1)

    # Without it: the weights are the saved ones, and AdamW starts afresh.
    fresh = service_client.create_training_client_from_state(state).result()
    np.testing.assert_allclose(forward_logprobs(fresh, datum), at_save, atol=1e-6, rtol=0)
    train(fresh, datum, 2)
    restarted = forward_logprobs(fresh, datum)
    assert np.abs(restarted - final_a).max() > 1e-4, "a restarted optimizer must not reproduce the resumed run"

    # Independent reference: PEFT loads the saved adapter and a new torch AdamW takes the same two steps.
    sampler_path = run_b.save_weights_for_sampler("after-2").result().path
    model = reference_peft_model(tiny_model_dir, checkpoint_dir(server.data_dir, sampler_path), trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                  weight_decay=ADAM.weight_decay)
    _, _, weights = datum_arrays(datum)
    for _ in range(2):
        loss = -(reference_logprobs(model, datum) * torch.tensor(weights)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        np.testing.assert_allclose(restarted, reference_logprobs(model, datum).numpy(), atol=1e-5, rtol=0)


def test_save_state_overwrite_replaces_the_checkpoint_of_that_name(service_client, server, datum):
    """A second save under one name is refused, unless ``overwrite=True``: then the name holds the newer weights
    (listed once, and loading it gives them)."""
    run = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    train(run, datum, 1)
    first = run.save_state("latest").result().path
    expect_user_error(run.save_state("latest"), "already exists")
    train(run, datum, 2)
    newer = forward_logprobs(run, datum)
    assert run.save_state("latest", overwrite=True).result().path == first
    listed = tinker.RestClient(base_url=server.base_url, api_key=MAIN_KEY).list_checkpoints(
        run.model_id).result().checkpoints
    assert [c.tinker_path for c in listed].count(first) == 1
    loaded = service_client.create_training_client_from_state(first).result()
    np.testing.assert_allclose(forward_logprobs(loaded, datum), newer, atol=1e-6, rtol=0)


def test_named_sampler_saves_in_flight_keep_their_names_and_weights(service_client, server, datum):
    """Named sampler saves are written after their turn in the run's order, while the run goes on: requests sent back
    to back with their seq ids (the SDK numbers a save only once its event loop sends it, so raw HTTP fixes the
    order) — forward_backward, a save, the same name again, optim_step, another save — give the first save the
    weights of its turn (the untrained LoRA: the base model's), a user error to the repeated name, and the second
    save the trained weights."""
    run = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result()
    url, headers = server.base_url, {"X-API-Key": MAIN_KEY}

    def post(path: str, body: dict) -> str:
        answer = httpx.post(f"{url}/api/v1/{path}", headers=headers, json={"model_id": run.model_id, **body},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["request_id"]

    sent = [one_request(url, MAIN_KEY, run.model_id, 1, [datum]),
            post("save_weights_for_sampler", {"path": "twice", "seq_id": 2}),
            post("save_weights_for_sampler", {"path": "twice", "seq_id": 3}),
            post("optim_step", {"seq_id": 4, "adam_params": {"learning_rate": 1e-2}}),
            post("save_weights_for_sampler", {"path": "trained", "seq_id": 5}),
            one_request(url, MAIN_KEY, run.model_id, 6, [datum])]  # its logprobs: the trained weights'
    _, first, repeated, _, second, trained = (poll_future(url, request_id, MAIN_KEY) for request_id in sent)
    assert "already exists" in repeated["error"] and repeated["category"] == "user"
    tokens = types.ModelInput.from_ints(PROMPT + COMPLETION)

    def logprobs(**where) -> np.ndarray:
        return np.asarray(service_client.create_sampling_client(**where).result().compute_logprobs(tokens).result()[1:])

    base = logprobs(base_model=BASE_MODEL)
    np.testing.assert_allclose(logprobs(model_path=first["path"]), base, atol=1e-5)
    after_step = deserialize_forward_backward_output(trained).loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(after_step - base).max() > 1e-3  # the step moved the weights, so the two saves differ
    np.testing.assert_allclose(logprobs(model_path=second["path"]), after_step, atol=1e-4)
    listed = tinker.RestClient(base_url=url, api_key=MAIN_KEY).list_checkpoints(run.model_id).result().checkpoints
    assert sorted(c.tinker_path for c in listed) == sorted([first["path"], second["path"]])


def test_pipelined_submission_equals_waiting(service_client, datum):
    pipelined = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()
    waited = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()
    futures = []
    for _ in range(3):  # submitted back to back, nothing awaited in between
        futures.append(pipelined.forward_backward([datum], "cross_entropy"))
        futures.append(pipelined.optim_step(ADAM))
    pipelined_losses = [f.result().metrics["loss:sum"] for f in futures[0::2]]
    for f in futures[1::2]:
        f.result()
    waited_losses = train(waited, datum, 3)
    assert pipelined_losses == pytest.approx(waited_losses, abs=1e-6)
    np.testing.assert_allclose(forward_logprobs(pipelined, datum), forward_logprobs(waited, datum), atol=1e-6,
                               rtol=0)


@pytest.mark.timeout(100)  # a request stuck behind a missing seq_id would wait the 120 s gap timeout
def test_bad_input_is_a_user_error_and_the_server_keeps_serving(service_client, datum, server):
    with pytest.raises(tinker.RequestFailedError) as info:
        service_client.create_lora_training_client(base_model="no-such/model", rank=4).result()
    assert info.value.category == types.RequestErrorCategory.User and "unknown base model" in str(info.value)
    with pytest.raises(tinker.RequestFailedError) as info:  # the samplers could not load it: refused up front
        service_client.create_lora_training_client(base_model=BASE_MODEL, rank=256).result()
    assert info.value.category == types.RequestErrorCategory.User and "--max-lora-rank 128" in str(info.value)

    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    tokens, targets, weights = datum_arrays(datum)

    def custom(model_tokens, loss_inputs):
        return types.Datum(model_input=types.ModelInput.from_ints(model_tokens), loss_fn_inputs=loss_inputs)

    too_big = custom([*tokens[:-1], 600_000], {"target_tokens": targets, "weights": weights})
    expect_user_error(client.forward_backward([too_big], "cross_entropy"), "token ids", "[0, 512)")

    short_weights = custom(tokens, {"target_tokens": targets, "weights": weights[:-2]})
    expect_user_error(client.forward_backward([short_weights], "cross_entropy"), "weights has shape")

    int_weights = custom(tokens, {"target_tokens": targets, "weights": np.asarray(weights).astype(np.int64)})
    expect_user_error(client.forward_backward([int_weights], "cross_entropy"), "weights must be float32, got int64")

    nan_weights = custom(tokens, {"target_tokens": targets, "weights": np.where(weights > 0, np.nan, 0).astype(np.float32)})
    expect_user_error(client.forward_backward([nan_weights], "cross_entropy"), "NaN")

    long_tokens = list(range(2100))
    too_long = custom(long_tokens, {"target_tokens": np.array(long_tokens, dtype=np.int64) % 512,
                                    "weights": np.ones(2100, dtype=np.float32)})
    expect_user_error(client.forward_backward([too_long], "cross_entropy"), "maximum context length of 2048")

    expect_user_error(client.forward_backward([datum], "no_such_loss"), "unknown loss_fn")

    # Rejected while decoding, yet it takes its turn: the next request is not held up waiting for its seq_id.
    image = types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                        loss_fn_inputs={"target_tokens": np.array([1], np.int64), "weights": np.ones(1, np.float32)})
    expect_user_error(client.forward_backward([image], "cross_entropy"), "'image' is not supported")

    expect_user_error(client.optim_step(types.AdamParams(learning_rate=1e-3, eps=0.0)), "eps must be > 0")

    expect_user_error(client.forward_backward([datum], "cross_entropy", loss_fn_config={"clip": 0.2}),
                       "loss_fn_config keys")

    # Nothing above touched the adapter: the same client still trains, and its first loss is the untrained one.
    fresh = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    assert train(client, datum, 2) == pytest.approx(train(fresh, datum, 2), abs=1e-6)
    assert server.alive()


def test_concurrent_runs_share_trainer_batches_and_get_their_own_results(service_client, server):
    """Several training clients submitting at once are batched together on the trainer (the metrics say so), and
    each gets exactly the loss and logprobs it gets on its own."""
    rng = np.random.default_rng(21)
    clients = [service_client.create_lora_training_client(base_model=BASE_MODEL, rank=r, seed=s).result()
               for r, s in ((2, 1), (4, 2), (8, 3), (4, 4), (2, 5), (8, 6))]
    data = [make_datum(rng.integers(0, 500, size=6).tolist(), rng.integers(0, 500, size=3).tolist())
            for _ in clients]
    for client, datum in zip(clients, data, strict=True):  # a first step, so every adapter differs from the base
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(ADAM).result()
    before = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()
    for _ in range(3):
        futures = [c.forward_backward([d] * 4, "cross_entropy") for c, d in zip(clients, data, strict=True)]
        together = [f.result() for f in futures]
    after = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()
    stats, earlier = after["training"][BASE_MODEL], before["training"][BASE_MODEL]
    requests, batches = stats["requests"] - earlier["requests"], stats["batches"] - earlier["batches"]
    assert requests >= 3 * len(clients) and batches < requests, (requests, batches)  # requests shared batches
    for client, datum, result in zip(clients, data, together, strict=True):
        alone = client.forward([datum] * 4, "cross_entropy").result()
        assert result.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
        np.testing.assert_allclose(result.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                   alone.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-5)


def test_closing_a_session_frees_its_training_runs(server, datum):
    """``ServiceClient.close`` ends the session: its runs leave the trainer (their adapter slots count against
    ``--max-adapters`` and ``--max-adapters-per-key`` no more), their checkpoints stay and load into a new client."""
    key = "tml-test-close-session"
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    run = service.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
    state = run.save_state("kept").result().path
    expected = forward_logprobs(run, datum)
    session_id = service.holder.get_session_id()
    service.close("success").result()
    line = next(line for line in server.log().splitlines() if f"session finished: {session_id}" in line)
    assert f"models unloaded: {run.model_id}" in line
    resumed = tinker.ServiceClient(base_url=server.base_url, api_key=key).create_training_client_from_state(
        state).result()
    np.testing.assert_allclose(forward_logprobs(resumed, datum), expected, atol=1e-6, rtol=0)
