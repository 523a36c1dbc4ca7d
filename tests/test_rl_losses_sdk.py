"""One RL step per loss through the real SDK and server: sample, compute advantages, forward_backward with the
sampler's logprobs, optim_step. The loss the server reports equals the formula applied, here, to the logprobs it
returned. Also: stable_reinforce's recorded stability info and provenance, and forward_backward_custom."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tests.helpers import (
    BASE_MODEL,
    MAIN_KEY,
    expect_user_error,
    reference_gspo,
    reference_rl,
    reference_stable_reinforce,
)

PROMPT = [11, 42, 77, 103, 250]
P = len(PROMPT)
DEFAULTS = {"cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
            "stable_reinforce": {"clip_high_threshold": 2.0, "kl_coeff": 0.0}}


def rollout(client, record: bool = False):
    sampler = client.save_weights_and_get_sampling_client(record_stability_info=record).result()
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 4,
                            types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])).result()
    rewards = np.array([len(set(s.tokens)) for s in result.sequences], dtype=np.float64)
    return result.sequences, rewards - rewards.mean()


def rl_datum(seq, advantage: float, loss_fn: str, client_shift: float = 0.0) -> tuple[types.Datum, dict]:
    """The cookbook's single-turn layout: placeholder prompt targets with advantage 0; sampler logprobs (shifted by
    ``client_shift`` to show which logprobs the server uses); the gspo mask and the provenance spans as needed."""
    tokens = PROMPT + seq.tokens
    arrays = {
        "target_tokens": np.array([0] * (P - 1) + seq.tokens, dtype=np.int64),
        "logprobs": np.array([0.0] * (P - 1) + seq.logprobs, dtype=np.float32) + np.float32(client_shift),
        "advantages": np.array([0.0] * (P - 1) + [advantage] * len(seq.tokens), dtype=np.float32),
    }
    if loss_fn == "gspo":
        arrays["sequence_ratio_mask"] = np.array([0.0] * (P - 1) + [1.0] * len(seq.tokens), dtype=np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=dict(arrays))
    if loss_fn == "stable_reinforce":
        sid = seq.sequence_id
        datum = datum.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=P),
                         types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=len(seq.tokens) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=P - 1),
                            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=len(seq.tokens))])
    return datum, arrays


def reference(loss_fn: str, learner: np.ndarray, arrays: dict, seq, config: dict) -> float:
    sampler_lp, advantages = arrays["logprobs"].astype(np.float64), arrays["advantages"].astype(np.float64)
    if loss_fn == "gspo":
        return reference_gspo(learner, sampler_lp, advantages, arrays["sequence_ratio_mask"],
                              config["clip_low_threshold"], config["clip_high_threshold"])[0]
    if loss_fn == "stable_reinforce":
        recorded = np.array([0.0] * (P - 1) + seq.logprobs)  # what the sampler returned, hence recorded
        mask = np.array([0.0] * (P - 1) + [1.0] * len(seq.tokens))
        return reference_stable_reinforce(learner, sampler_lp, advantages, recorded, mask,
                                          config["clip_high_threshold"], config["kl_coeff"])[0]
    return reference_rl(loss_fn, learner, sampler_lp, advantages, config)[0]


@pytest.mark.parametrize(("loss_fn", "config"), [
    ("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None), ("dro", {"beta": 0.1}), ("gspo", None), ("gspo", {"clip_low_threshold": 0.5}),
    ("stable_reinforce", None), ("stable_reinforce", {"kl_coeff": 0.5}),
])
def test_one_rl_step(service_client, loss_fn, config):
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    sequences, advantages = rollout(client, record=loss_fn == "stable_reinforce")
    # stable_reinforce takes the sampler's logprobs from its own records: the client's copy is shifted to prove it
    shift = 0.25 if loss_fn == "stable_reinforce" else 0.0
    built = [rl_datum(seq, adv, loss_fn, shift) for seq, adv in zip(sequences, advantages)]
    out = client.forward_backward([d for d, _ in built], loss_fn, loss_fn_config=config).result()
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    resolved = {**DEFAULTS.get(loss_fn, {}), **(config or {})}
    total = 0.0
    for output, (_, arrays), seq in zip(out.loss_fn_outputs, built, sequences):
        learner = output["logprobs"].to_numpy().astype(np.float64)
        assert learner.shape == (P - 1 + len(seq.tokens),)
        # Fresh adapter (LoRA B = 0) and the same weights in sampler and trainer: the ratio starts at 1.
        np.testing.assert_allclose(learner[P - 1:], seq.logprobs, atol=1e-4)
        total += reference(loss_fn, learner, arrays, seq, resolved)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-4)


def test_stable_reinforce_refuses_sequences_it_cannot_vouch_for(service_client, server):
    import tinker

    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    unrecorded, _ = rollout(client, record=False)
    datum, _ = rl_datum(unrecorded[0], 1.0, "stable_reinforce")
    expect_user_error(client.forward_backward([datum], "stable_reinforce"), "no recorded stability info",
                      "record_stability_info=True")
    no_spans = types.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs)
    expect_user_error(client.forward_backward([no_spans], "stable_reinforce"), "needs provenance")

    recorded, _ = rollout(client, record=True)
    datum, arrays = rl_datum(recorded[0], 1.0, "stable_reinforce")
    wrong_tokens = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        **arrays, "target_tokens": arrays["target_tokens"][::-1].copy()}).with_provenance(
        model_input=datum.model_input_spans, loss_fn_inputs=datum.loss_fn_input_spans)
    expect_user_error(client.forward_backward([wrong_tokens], "stable_reinforce"), "the tokens differ")
    sneaky = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        **arrays, "recorded_logprobs": np.zeros(len(arrays["logprobs"]), np.float32)}).with_provenance(
        model_input=datum.model_input_spans, loss_fn_inputs=datum.loss_fn_input_spans)
    expect_user_error(client.forward_backward([sneaky], "stable_reinforce"), "filled in by the server")

    # Another session (another ServiceClient) may not train on this session's sequences.
    other = tinker.ServiceClient(base_url=server.base_url, api_key=MAIN_KEY)
    try:
        other_client = other.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
        expect_user_error(other_client.forward_backward([datum], "stable_reinforce"), "only within one session")
    finally:
        other.close("success")
    assert client.forward_backward([datum], "stable_reinforce").result().metrics["loss:sum"] is not None


def test_forward_backward_custom_gives_the_same_step_as_the_builtin_loss(service_client):
    """A user-written weighted log-likelihood through forward_backward_custom (forward, client-side loss, backward
    with the linearised loss) must move the weights exactly as cross_entropy with those weights does."""
    rng = np.random.default_rng(4)
    data = []
    for n in (9, 6):
        tokens = rng.integers(0, 500, size=n + 1)
        weights = rng.uniform(0.0, 2.0, size=n).astype(np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    clients = [service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=9).result()
               for _ in range(2)]

    def weighted_nll(batch, logprobs_list):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum()
                   for d, lp in zip(batch, logprobs_list))
        return loss, {"tokens:sum": float(sum(len(lp) for lp in logprobs_list))}

    adam = types.AdamParams(learning_rate=5e-3)
    for _ in range(2):  # the second step starts from moved weights, so the LoRA A and B both get gradients
        builtin = clients[0].forward_backward(data, "cross_entropy").result()
        custom = clients[1].forward_backward_custom(data, weighted_nll).result()
        assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
        assert custom.metrics["tokens:sum"] == 15
        # the SDK sends weights = -dC/dlogprobs = w back, so the server's CE of that pass is the loss itself
        assert custom.metrics["surrogate_loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
        for client in clients:
            client.optim_step(adam).result()
    after = [[o["logprobs"].to_numpy() for o in c.forward(data, "cross_entropy").result().loss_fn_outputs]
             for c in clients]
    before = [o["logprobs"].to_numpy() for o in builtin.loss_fn_outputs]
    for a, b, old in zip(after[0], after[1], before):
        assert np.abs(a - old).max() > 1e-3  # the steps did move the model…
        np.testing.assert_allclose(a, b, atol=1e-5)  # …identically


def test_several_targets_per_position(service_client):
    """``(N, K)`` targets: each column's logprobs equal a one-target forward of that column, and the
    importance_sampling loss over the grid equals the formula on them; a sparse CSR cross-entropy batch agrees."""
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    rng = np.random.default_rng(8)
    tokens = types.ModelInput.from_ints(rng.integers(0, 500, size=7).tolist())
    targets = rng.integers(0, 500, size=(7, 3))
    sampler_lp = (-rng.exponential(size=(7, 3)) - 5).astype(np.float32)
    advantages = rng.normal(size=(7, 3)).astype(np.float32)
    out = client.forward_backward([types.Datum(model_input=tokens, loss_fn_inputs={
        "target_tokens": targets, "logprobs": sampler_lp, "advantages": advantages})], "importance_sampling").result()
    grid = out.loss_fn_outputs[0]["logprobs"].to_numpy().reshape(7, 3).astype(np.float64)
    columns = client.forward([types.Datum(model_input=tokens, loss_fn_inputs={
        "target_tokens": targets[:, k], "weights": np.ones(7, np.float32)}) for k in range(3)],
        "cross_entropy").result()
    for k, column in enumerate(columns.loss_fn_outputs):
        np.testing.assert_allclose(grid[:, k], column["logprobs"].to_numpy(), atol=1e-5)
    expected = reference_rl("importance_sampling", grid, sampler_lp.astype(np.float64), advantages.astype(np.float64),
                            {})[0]
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)

    weights = torch.zeros(7, 3)
    weights[2, 1], weights[5, 0] = 0.7, 0.3
    sparse = types.Datum(model_input=tokens, loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(torch.tensor(targets)),
        "weights": types.TensorData.from_torch_sparse(weights)})
    ce = client.forward([sparse], "cross_entropy").result()
    assert ce.metrics["loss:sum"] == pytest.approx(-(0.7 * grid[2, 1] + 0.3 * grid[5, 0]), rel=1e-4)
