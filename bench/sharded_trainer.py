"""A trainer on one process against the same trainer split over two (``--trainer-shards 2``): what each process
holds and how fast the server trains, through the SDK.

The server as users run it: ``compat-server serve`` with its defaults, and again with ``--trainer-shards 2``. One
training client sends ``--steps`` steps of ``forward_backward`` (``--batch`` datums of ``--tokens`` tokens) and
``optim_step`` after a first step not timed. Figures per trainer process (pids from ``/api/v1/metrics``): the bytes of
base weights it holds (measured inside it, from its weights' storages), its resident memory (``VmRSS``) and peak
(``VmHWM``) after the steps; and the server's tokens/s. On CPU the shards talk through gloo.

    python -m bench.sharded_trainer [--shape cpu-mid] [--steps 5] [--batch 8] [--tokens 256]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.activation_memory import _status_kib
from bench.common import model_directory, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="cpu-mid")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    directory = model_directory(args.shape)
    rows = []
    try:
        for shards in (1, 2):
            rows.extend(measure(directory, args, shards))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    write("sharded_trainer", {"shape": args.shape, "steps": args.steps, "batch": args.batch, "tokens": args.tokens,
                              "rank": args.rank, "through": "the server with its defaults and --trainer-shards N"},
          rows)


def measure(directory: Path, args, shards: int) -> list[dict]:
    import tinker
    from tinker import types

    from tests.server import start_server

    flags = ("--trainer-shards", str(shards)) if shards > 1 else ()
    server = start_server(Path(tempfile.mkdtemp(prefix="bench-shards-")), "--base-model", str(directory), *flags,
                          timeout=900)
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
        client = service.create_lora_training_client(base_model=str(directory), rank=args.rank, seed=0).result()
        rng = np.random.default_rng(0)

        def step() -> None:
            data = []
            for _ in range(args.batch):
                tokens = rng.integers(1, 30000, args.tokens + 1).tolist()
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": tokens[1:], "weights": [1.0] * args.tokens}))
            fb = client.forward_backward(data, "cross_entropy")
            opt = client.optim_step(types.AdamParams(learning_rate=1e-4))
            fb.result()
            opt.result()

        step()
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        seconds = time.perf_counter() - started
        time.sleep(3)  # the pool reads what each process holds every 2 s
        trainer = httpx.get(f"{server.base_url}/api/v1/metrics", headers={"X-API-Key": server.admin_key}).json()[
            "training"][str(directory)]
        tokens_per_second = args.steps * args.batch * args.tokens / seconds
        rows = [{"shards": shards, "rank_of_shard": shard["rank"], "base_weights_mib": shard["base_bytes"] / 2**20,
                 "rss_mib": _status_kib(shard["pid"], "VmRSS") / 1024,
                 "peak_rss_mib": _status_kib(shard["pid"], "VmHWM") / 1024, "tokens_per_s": tokens_per_second}
                for shard in trainer["shards"]]
        service.close("success")
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
