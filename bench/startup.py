"""Time from ``compat-server serve`` to its ready line, and from create_model to the first finished training step.

    python -m bench.startup [--runs 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from adapters.models.tiny import TINY_MODEL_NAME, ensure_tiny_model
from bench.common import write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    import tinker
    from tinker import types

    from tests.server import start_server

    ensure_tiny_model()  # built once beforehand: the first-ever start also builds the model (measured separately)
    rows = []
    for run in range(args.runs):
        started = time.perf_counter()
        server = start_server(Path(tempfile.mkdtemp(prefix="bench-startup-")))
        ready = time.perf_counter() - started
        try:
            service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
            started = time.perf_counter()
            client = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=8, seed=0).result()
            tokens = list(range(1, 34))
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                                "weights": np.ones(32, np.float32)})
            client.forward_backward([datum], "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            first_step = time.perf_counter() - started
            service.close("success")
        finally:
            server.stop()
        rows.append({"run": run, "serve_to_ready_s": ready, "create_model_to_first_step_s": first_step})
    write("startup", vars(args), rows)


if __name__ == "__main__":
    main()
