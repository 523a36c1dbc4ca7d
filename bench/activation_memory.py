"""Peak memory of one training step against its sequence length, with and without activation checkpointing.

The server started with ``--activation-checkpointing-tokens 1`` (every training pass checkpointed) and again with
``--activation-checkpointing-tokens 0`` (every activation kept; by default the trainer chooses between the two pass
by pass, by the memory free: ``adapters/trainer/memory.py``), one SDK ``forward_backward`` of one
datum per length, lengths rising. On CPU the figure is the trainer actor's peak resident memory (``VmHWM`` of its
process, whose pid ``/api/v1/metrics`` gives an operator) above what it held once loaded; on a GPU it would be
``max_memory_allocated`` inside the trainer, which this script does not reach (see ``bench/RESULTS.md``).

    python -m bench.activation_memory [--shape cpu-mid] [--lengths 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import model_directory, write

MODES = {"kept (--activation-checkpointing-tokens 0)": ("--activation-checkpointing-tokens", "0"),
         "checkpointed (--activation-checkpointing-tokens 1)": ("--activation-checkpointing-tokens", "1")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="cpu-mid")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    directory = model_directory(args.shape)
    rows = []
    try:
        for mode, flags in MODES.items():
            rows.extend(measure(directory, args, mode, flags))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    write("activation_memory", {"shape": args.shape, "lengths": args.lengths, "rank": args.rank,
                                "measured": "trainer actor VmHWM above its resident size once loaded"}, rows)


def measure(directory: Path, args, mode: str, flags: tuple[str, ...]) -> list[dict]:
    import tinker
    from tinker import types

    from tests.server import start_server

    server = start_server(Path(tempfile.mkdtemp(prefix="bench-memory-")), "--base-model", str(directory), *flags,
                          timeout=900)
    rows = []
    try:
        headers = {"X-API-Key": server.admin_key}
        training = httpx.get(f"{server.base_url}/api/v1/metrics", headers=headers).json()["training"]
        pid = training[str(directory)]["pid"]
        loaded = _status_kib(pid, "VmRSS")
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
        client = service.create_lora_training_client(base_model=str(directory), rank=args.rank, seed=0).result()
        rng = np.random.default_rng(0)
        for length in sorted(args.lengths):
            tokens = rng.integers(1, 30000, length + 1).tolist()
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "weights": [1.0] * length})
            started = time.perf_counter()
            client.forward_backward([datum], "cross_entropy").result()
            seconds = time.perf_counter() - started
            peak = _status_kib(pid, "VmHWM")
            rows.append({"mode": mode, "tokens": length, "peak_above_loaded_mib": (peak - loaded) / 1024,
                         "seconds": seconds})
        service.close("success")
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)
    return rows


def _status_kib(pid: int, field: str) -> int:
    """A field of ``/proc/PID/status`` in KiB (``VmRSS`` now, ``VmHWM`` the peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


if __name__ == "__main__":
    main()
