"""What the server adds to a training step: one tinker SDK forward_backward + optim_step round trip against the real
server, versus the same step on the same model in-process (MultiLoRATrainer called directly).

    python -m bench.server_overhead [--steps 30] [--length 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from adapters.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from adapters.trainer import AdamHyper, LoraSpec, MultiLoRATrainer
from bench.common import write
from shims.training_wire import DatumArrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 500, size=args.length + 1)

    trainer = MultiLoRATrainer(str(ensure_tiny_model()))
    trainer.create("m", LoraSpec(rank=8, seed=0))
    datum = DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:],
                                                             "weights": np.ones(args.length, np.float32)})
    in_process = _timed(args.steps, lambda: (trainer.forward_backward("m", [datum], "cross_entropy", {}, False),
                                             trainer.optim_step("m", AdamHyper(learning_rate=1e-4))))

    import tinker
    from tinker import types

    from tests.server import start_server

    server = start_server(Path(tempfile.mkdtemp(prefix="bench-server-")))
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
        client = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=8, seed=0).result()
        sdk_datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(args.length,
                                                                                                 np.float32)})
        adam = types.AdamParams(learning_rate=1e-4)
        through_server = _timed(args.steps, lambda: (client.forward_backward([sdk_datum], "cross_entropy").result(),
                                                     client.optim_step(adam).result()))
        service.close("success")
    finally:
        server.stop()
    write("server_overhead", vars(args), [
        {"path": "in-process trainer", "ms_per_step": in_process * 1e3},
        {"path": "tinker SDK → server", "ms_per_step": through_server * 1e3},
        {"path": "overhead", "ms_per_step": (through_server - in_process) * 1e3,
         "ms_per_call": (through_server - in_process) * 1e3 / 2, "ratio": through_server / in_process},
    ])


def _timed(steps: int, step) -> float:
    step()  # warm-up
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return float(np.median(seconds))


if __name__ == "__main__":
    main()
