"""The server process calls its trainers and samplers through torch-free interfaces (``adapters.trainer.interface``,
``adapters.samplers.interface``) and never imports their model code: that lives in the Ray actors' processes alone.
A server started in a fresh process and driven through training, checkpoints, sampling and a streamed chat must not
have loaded any of it. (``torch`` itself is loaded, by the tinker SDK's own wire types the routes decode with.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import skip_without_vllm

MODEL_CODE = (
    "adapters.trainer.actor", "adapters.trainer.passes", "adapters.trainer.forward", "adapters.trainer.files",
    "adapters.trainer.optim", "adapters.trainer.table", "adapters.trainer.shards", "adapters.trainer.recompute",
    "adapters.trainer.dimuon", "adapters.lora.model", "adapters.lora.linear", "adapters.lora.experts",
    "adapters.lora.routing", "adapters.lora.targets", "adapters.lora.files", "adapters.samplers.hf",
    "adapters.samplers.grammar", "adapters.samplers.replica", "adapters.samplers.vllm.sampler",
    "adapters.samplers.vllm.patches", "adapters.samplers.vllm.results", "vllm", "peft",
)
"""What runs inside the trainer and sampler actors: the trainer and its parts, the LoRA modules, the sampler
backends (and the actor class that holds one), vLLM and PEFT. A package listed stands for its submodules too."""

DRIVE = """
import sys, threading, time
import numpy as np
import openai, tinker, uvicorn
from tinker import types
from compat_server.app import create_app
from compat_server.cli.main import build_parser, config_from_args

port, data_dir, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3]
config = config_from_args(build_parser().parse_args([
    "serve", "--port", str(port), "--data-dir", data_dir, "--poll-hold-seconds", "2", "--sampler-backend", backend]))
server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
thread = threading.Thread(target=server.run, daemon=True)
thread.start()
deadline = time.monotonic() + 400
while not server.started:
    assert time.monotonic() < deadline, "the server did not start"
    time.sleep(0.2)
url = f"http://127.0.0.1:{port}"
service = tinker.ServiceClient(base_url=url, api_key="tml-imports")
client = service.create_lora_training_client(base_model="compat-server/tiny-qwen3", rank=2, seed=1).result()
datum = types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5]),
                    loss_fn_inputs={"target_tokens": np.array([4, 5, 6], dtype=np.int64),
                                    "weights": np.array([0.0, 1.0, 1.0], dtype=np.float32)})
client.forward_backward([datum], "cross_entropy").result()
client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
client.save_state("kept").result()
sampler = client.save_weights_and_get_sampling_client().result()
sampler.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=3)).result()
chat = openai.OpenAI(base_url=f"{url}/v1", api_key="tml-imports")
list(chat.chat.completions.create(model="compat-server/tiny-qwen3", max_tokens=3, stream=True,
                                  messages=[{"role": "user", "content": "hi"}]))
service.close("success").result()
inside = tuple(f"{name}." for name in MODEL_CODE)
loaded = sorted(name for name in sys.modules if name in MODEL_CODE or name.startswith(inside))
server.should_exit = True
thread.join(60)
print("loaded:", loaded)
"""


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_the_server_process_loads_no_trainer_or_sampler_model_code(backend, model_cache, tmp_path):
    if backend == "vllm":
        skip_without_vllm()
    from tests.server import free_port

    script = f"MODEL_CODE = {MODEL_CODE!r}\n" + DRIVE
    run = subprocess.run([sys.executable, "-c", script, str(free_port()), str(tmp_path), backend],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1] == "loaded: []", run.stdout
