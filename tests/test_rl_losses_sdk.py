"""One RL step per loss through the real SDK and server: sample, compute advantages, forward_backward with the
sampler's logprobs, optim_step. The loss the server reports equals the formula applied, here, to the logprobs it
returned."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tests.helpers import BASE_MODEL, reference_rl

PROMPT = [11, 42, 77, 103, 250]


@pytest.mark.parametrize(("loss_fn", "config"), [
    ("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None), ("dro", {"beta": 0.1}),
])
def test_one_rl_step(service_client, loss_fn, config):
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 4,
                            types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])).result()
    rewards = np.array([len(set(s.tokens)) for s in result.sequences], dtype=np.float64)
    data, expected_inputs = [], []
    for seq, advantage in zip(result.sequences, rewards - rewards.mean()):
        tokens = PROMPT + seq.tokens
        n = len(tokens) - 1
        sampler_lp = np.array([0.0] * (len(PROMPT) - 1) + seq.logprobs, dtype=np.float32)
        advantages = np.array([0.0] * (len(PROMPT) - 1) + [advantage] * len(seq.tokens), dtype=np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64), "logprobs": sampler_lp,
            "advantages": advantages}))
        expected_inputs.append((sampler_lp.astype(np.float64), advantages.astype(np.float64), n))
    out = client.forward_backward(data, loss_fn, loss_fn_config=config).result()
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    resolved = {"importance_sampling": {}, "ppo": config, "cispo": {"clip_low_threshold": 0.0,
                                                                   "clip_high_threshold": 4.0}, "dro": config}[loss_fn]
    total = 0.0
    for output, (sampler_lp, advantages, n) in zip(out.loss_fn_outputs, expected_inputs):
        learner = output["logprobs"].to_numpy().astype(np.float64)
        assert learner.shape == (n,)
        # Fresh adapter (LoRA B = 0) and the same weights in sampler and trainer: the ratio starts at 1.
        np.testing.assert_allclose(learner[len(PROMPT) - 1:], sampler_lp[len(PROMPT) - 1:], atol=1e-4)
        total += reference_rl(loss_fn, learner, sampler_lp, advantages, resolved)[0]
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-4)
