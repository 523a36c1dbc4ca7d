"""The multi-LoRA trainer in-process: failures leave adapters exactly as they were."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.trainer import AdamHyper, LoraSpec, MultiLoRATrainer
from shims.errors import UserError
from shims.training_wire import DatumArrays

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
    huge = DatumArrays(tokens=DATUM.tokens, loss_fn_inputs={**DATUM.loss_fn_inputs,
                                                            "weights": np.full(5, 3e38, np.float32)})
    with pytest.raises(UserError, match="not finite"):
        trainer.forward_backward("e", [huge], "cross_entropy", {}, False)
    np.testing.assert_array_equal(logprobs(trainer, "e"), start)
    assert trainer.optim_step("e", AdamHyper())["step"] == 1.0
