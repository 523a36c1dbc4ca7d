"""What the server adds to a training step, and what several clients at once cost.

1. One tinker SDK ``forward_backward`` + ``optim_step`` round trip against the real server, versus the same step on
   the same model in-process (``MultiLoRATrainer`` called directly): each call awaited before the next is sent, and
   both sent before either is awaited (tinker-cookbook's training loops, ``../shared/reference/tinker_minimal.py``).
2. ``--clients`` SDK clients (each its own session and training run, each in its own thread) doing ``--client-steps``
   steps at once, versus one client doing the same steps alone: the ratio of wall times. 1.0 would mean the other
   clients cost nothing (their steps batched with and overlapping this one's); ``clients`` would mean no sharing.

    python -m bench.server_overhead [--steps 30] [--length 32] [--clients 4] [--client-steps 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil

from adapters.models.tiny import TINY_MODEL_NAME, ensure_tiny_model
from adapters.trainer.actor import AdamHyper, LoraSpec, MultiLoRATrainer
from bench.common import write
from shims.tinker.training_wire import DatumArrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed round trips (the median is reported)")
    parser.add_argument("--length", type=int, default=32, help="tokens per datum")
    parser.add_argument("--clients", type=int, default=4, help="clients training at once in the second figure")
    parser.add_argument("--client-steps", type=int, default=8, help="steps each of those clients takes")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the second figure (the median is kept)")
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

    sdk_datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(args.length, np.float32)})
    adam = types.AdamParams(learning_rate=1e-4)
    server = start_server(Path(tempfile.mkdtemp(prefix="bench-server-")))
    services = [tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench") for _ in range(args.clients)]
    try:
        clients = [service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=8, seed=0).result()
                   for service in services]

        def step(client) -> None:
            client.forward_backward([sdk_datum], "cross_entropy").result()
            client.optim_step(adam).result()

        def steps(client) -> float:
            started = time.perf_counter()
            for _ in range(args.client_steps):
                step(client)
            return time.perf_counter() - started

        def sent_together(client) -> None:
            pending = client.forward_backward([sdk_datum], "cross_entropy"), client.optim_step(adam)
            for future in pending:
                future.result()

        through_server = _timed(args.steps, lambda: step(clients[0]))
        together_sent = _timed(args.steps, lambda: sent_together(clients[0]))
        alone, together = [], []
        cpu_alone, cpu_together = CpuMeter(server.process.pid), CpuMeter(server.process.pid)
        with ThreadPoolExecutor(args.clients) as pool:
            for _ in range(args.repeats):
                with cpu_alone:
                    alone.append(steps(clients[0]))
                started = time.perf_counter()
                with cpu_together:
                    list(pool.map(steps, clients))
                together.append(time.perf_counter() - started)
        for service in services:
            service.close("success")
    finally:
        server.stop()
    alone_s, together_s = float(np.median(alone)), float(np.median(together))
    alone_steps, together_steps = args.repeats * args.client_steps, args.repeats * args.client_steps * args.clients
    write("server_overhead", vars(args), [
        {"path": "in-process trainer", "ms_per_step": in_process * 1e3},
        {"path": "tinker SDK → server", "ms_per_step": through_server * 1e3},
        {"path": "tinker SDK → server, both calls sent before either is awaited", "ms_per_step": together_sent * 1e3},
        {"path": "overhead", "ms_per_step": (through_server - in_process) * 1e3,
         "ms_per_call": (through_server - in_process) * 1e3 / 2, "ratio": through_server / in_process},
        {"path": f"1 client × {args.client_steps} steps", "seconds": alone_s,
         **cpu_alone.per_step(alone_steps)},
        {"path": f"{args.clients} clients × {args.client_steps} steps at once", "seconds": together_s,
         "ratio": together_s / alone_s, **cpu_together.per_step(together_steps)},
    ])


class CpuMeter:
    """CPU time spent inside ``with`` blocks by the SDK clients (this process), the server process, its trainer
    actor, and every other process of the server (Ray's): where a step's CPU goes on a machine whose cores all
    processes share."""

    def __init__(self, server_pid: int) -> None:
        self.server = psutil.Process(server_pid)
        self.seconds: dict[str, float] = {}

    def _sample(self) -> dict[str, float]:
        parts = {"sdk_clients": psutil.Process().cpu_times(), "server": self.server.cpu_times()}
        others = []
        for child in self.server.children(recursive=True):
            try:
                name = "trainer" if "MultiLoRATrainer" in child.name() + " ".join(child.cmdline()) else "other"
                (others.append(child.cpu_times()) if name == "other" else parts.setdefault(name, child.cpu_times()))
            except psutil.NoSuchProcess:
                continue
        sampled = {name: t.user + t.system for name, t in parts.items()}
        sampled["ray_and_other"] = sum(t.user + t.system for t in others)
        return sampled

    def __enter__(self) -> None:
        self._start = self._sample()

    def __exit__(self, *_) -> None:
        for name, seconds in self._sample().items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds - self._start.get(name, 0.0)

    def per_step(self, steps: int) -> dict[str, float]:
        return {f"cpu_ms_per_step_{name}": round(seconds * 1e3 / steps, 2) for name, seconds in self.seconds.items()}


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
