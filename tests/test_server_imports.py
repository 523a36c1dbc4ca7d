"""The server process calls its trainers and samplers through torch-free interfaces (``adapters.trainer.interface``,
``adapters.samplers.interface``) and never imports their model code: that lives in the Ray actors' processes alone.
The run's shared servers (``tests/conftest.py``, one per sampler backend), driven by every test that uses them and
here through training, checkpoints, sampling and a streamed chat, must not have loaded any of it; they say which
modules they hold through ``tests.serve``. (``torch`` itself is loaded, by the tinker SDK's own wire types the
routes decode with.)"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL

MODEL_CODE = (
    "adapters.trainer.actor", "adapters.trainer.passes", "adapters.trainer.forward", "adapters.trainer.files",
    "adapters.trainer.optim", "adapters.trainer.table", "adapters.trainer.shards", "adapters.trainer.recompute",
    "adapters.trainer.dimuon", "adapters.lora.model", "adapters.lora.linear", "adapters.lora.experts",
    "adapters.lora.routing", "adapters.lora.targets", "adapters.lora.files", "adapters.samplers.hf",
    "adapters.samplers.grammar", "adapters.samplers.replica", "adapters.samplers.vllm.sampler",
    "adapters.samplers.vllm.patches", "adapters.samplers.vllm.results", "adapters.samplers.vllm.requests",
    "adapters.samplers.vllm.adapter_files", "vllm", "peft",
)
"""What runs inside the trainer and sampler actors: the trainer and its parts, the LoRA modules, the sampler
backends (and the actor class that holds one), vLLM and PEFT. A package listed stands for its submodules too."""



@pytest.fixture(params=["transformers", "vllm"])
def server(request):
    """Each shared server (``tests/conftest.py``): the processes the whole run drives, on either sampler backend."""
    return request.getfixturevalue(f"{request.param}_server")


def test_the_server_process_loads_no_trainer_or_sampler_model_code(server):
    # Whatever the run has done with it so far, at least this: training, checkpoints, sampling, a streamed chat.
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-imports")
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=1).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5]),
                        loss_fn_inputs={"target_tokens": np.array([4, 5, 6], dtype=np.int64),
                                        "weights": np.array([0.0, 1.0, 1.0], dtype=np.float32)})
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    client.save_state("kept").result()
    sampler = client.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=3)).result()
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-imports")
    list(chat.chat.completions.create(model=BASE_MODEL, max_tokens=3, stream=True,
                                      messages=[{"role": "user", "content": "hi"}]))
    service.close("success").result()

    modules = server.imported_modules()
    assert "compat_server.app" in modules and "torch" in modules  # the list is the server's, and whole
    inside = tuple(f"{name}." for name in MODEL_CODE)
    assert sorted(name for name in modules if name in MODEL_CODE or name.startswith(inside)) == []
