"""What the benchmarks share to measure the server as users run it: ``compat-server serve`` in its own process with
its default flags (plus any a row names), driven by the unmodified ``tinker`` SDK, so that each benchmark's
in-process figure has the figure users get beside it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from shims.tinker.training_wire import DatumArrays
from tests.server import RunningServer, start_server


@contextmanager
def served(directory: Path, *flags: str) -> Iterator[RunningServer]:
    """A server for the model at ``directory`` (a fresh data directory), stopped and removed after."""
    server = start_server(Path(tempfile.mkdtemp(prefix="bench-server-")), "--base-model", str(directory), *flags,
                          timeout=900)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)


def service_client(server: RunningServer, key: str = "tml-bench"):
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key=key)


def sdk_datums(rows: list[DatumArrays]) -> list:
    """The SDK's ``Datum`` for each of ``rows`` (tokens, target tokens and weights)."""
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(row.tokens.tolist()),
                        loss_fn_inputs={"target_tokens": row.loss_fn_inputs["target_tokens"].tolist(),
                                        "weights": row.loss_fn_inputs["weights"].tolist()})
            for row in rows]


def sdk_step(client, data: list, learning_rate: float = 1e-5) -> None:
    """One training step as a Tinker script makes it: ``forward_backward`` and ``optim_step`` sent together, then
    both results awaited."""
    from tinker import types

    fb = client.forward_backward(data, "cross_entropy")
    opt = client.optim_step(types.AdamParams(learning_rate=learning_rate))
    fb.result()
    opt.result()


def metrics(server: RunningServer) -> dict:
    """``/api/v1/metrics`` as the operator sees it."""
    return httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin, timeout=30).json()


def torch_threads(server: RunningServer) -> dict[str, list[int]]:
    """The torch threads each trainer process and each sampler worker runs with, as they report them."""
    answer = metrics(server)
    return {"trainer": [shard["torch_threads"] for trainer in answer["training"].values()
                        for shard in trainer["shards"]],
            "samplers": [n for base in answer["sampling"].values() for replica in base.get("replicas", [])
                         for n in replica["torch_threads"]]}
