"""Load: 32 concurrent SDK clients, each its own tenant, training and sampling against one server on CPU for a bounded
time (``COMPAT_SERVER_LOAD_SECONDS``, default 20 to keep CI short; the figures in ``bench/RESULTS.md`` are from
60-second runs).

What must hold: every call returns, and its result is the answer to that call (shapes and values tied to what the
client sent); the server recorded exactly one future per call, all finished (none lost, none duplicated); memory
stays bounded. The peak RSS of the server and its Ray workers and the server's retrieve_future and completion
latency percentiles are printed, and recorded in ``bench/RESULTS.md``; nothing here asserts on time.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import psutil
import pytest
import tinker
from tinker import types

from compat_server.access.auth import owner_of
from tests.helpers import ADAM, BASE_MODEL, make_datum
from tests.server import start_server

pytestmark = pytest.mark.soak

CLIENTS = 32
SECONDS = float(os.environ.get("COMPAT_SERVER_LOAD_SECONDS", "20"))
RSS_LIMIT_GIB = 8.0  # the whole server tree; it sits near 2 GiB on the tiny model


class RssMonitor(threading.Thread):
    """Samples the resident memory of a process and all its descendants (the Ray workers) twice a second."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def total(self) -> int:
        rss = 0
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                rss += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return rss

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            self.samples.append((time.monotonic(), self.total()))


def run_client(url: str, index: int, deadline: float) -> Counter:
    """One tenant's loop: forward_backward + optim_step every round, a sample every other round. Each request's
    sizes depend on the client and round, so an answer meant for another request would not fit."""
    calls: Counter = Counter()
    service = tinker.ServiceClient(base_url=url, api_key=f"tml-test-load-{index}")
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=index).result()
    calls["create_model"] += 1
    sampler = service.create_sampling_client(base_model=BASE_MODEL).result()
    rounds = 0
    while time.monotonic() < deadline:
        length = 2 + (index + rounds) % 6
        datum = make_datum([1 + index, 2 + rounds % 50], list(range(10 + index, 10 + index + length)))
        fb = training.forward_backward([datum], "cross_entropy")
        opt = training.optim_step(ADAM)
        calls["forward_backward"] += 1
        calls["optim_step"] += 1
        out = fb.result()
        logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
        assert logprobs.shape == (length + 1,), (index, rounds, logprobs.shape)
        weights = datum.loss_fn_inputs["weights"].to_numpy()
        assert np.isclose(out.metrics["loss:sum"], -(logprobs * weights).sum(), rtol=1e-4, atol=1e-4)
        opt.result()
        if rounds % 2 == 0:
            tokens, samples = 1 + (3 * index + rounds) % 9, 1 + (index + rounds) % 2
            result = sampler.sample(types.ModelInput.from_ints([5 + index, 6]), samples,
                                    types.SamplingParams(max_tokens=tokens, stop=[], seed=index)).result()
            calls["sample"] += 1
            assert [len(seq.tokens) for seq in result.sequences] == [tokens] * samples, (index, rounds)
        rounds += 1
    service.close("success")
    return calls


@pytest.mark.timeout(900)
def test_32_clients_train_and_sample_at_once_with_no_lost_or_duplicated_futures(model_cache, tmp_path, capsys):
    server = start_server(tmp_path / "data")
    try:
        url = server.base_url
        monitor = RssMonitor(server.process.pid)
        idle_rss = monitor.total()
        monitor.start()
        started = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            calls = list(pool.map(lambda i: run_client(url, i, started + SECONDS), range(CLIENTS)))
        elapsed = time.monotonic() - started
        monitor.stopped.set()
        monitor.join()
        metrics = httpx.get(f"{url}/api/v1/metrics", headers=server.admin).json()

        # Exactly one future per call, every one finished well.
        records = sqlite3.connect(f"file:{server.data_dir / 'records.sqlite3'}?mode=ro", uri=True)
        for index, expected in enumerate(calls):
            rows = records.execute("SELECT kind, state, COUNT(*) FROM futures WHERE owner = ? GROUP BY kind, state",
                                   [owner_of(f"tml-test-load-{index}")]).fetchall()
            assert {state for _, state, _ in rows} == {"complete"}, (index, rows)
            assert Counter({kind: count for kind, _, count in rows}) == expected, index
        total = sum(calls, Counter())
        assert total["forward_backward"] >= CLIENTS and total["sample"] >= CLIENTS  # every client did real work

        peak = max(rss for _, rss in monitor.samples)
        halfway = started + SECONDS / 2
        first_half = max(rss for t, rss in monitor.samples if t < halfway)
        second_half = max(rss for t, rss in monitor.samples if t >= halfway)
        assert peak < RSS_LIMIT_GIB * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"
        assert second_half < 1.25 * first_half, "memory kept growing under steady load"
        assert server.alive() and httpx.get(f"{url}/api/v1/healthz").status_code == 200
        futures = metrics["futures"]
        with capsys.disabled():
            print(f"\nload: {CLIENTS} clients for {elapsed:.0f} s: {dict(total)}; "
                  f"{total['forward_backward'] / elapsed:.1f} training steps/s, {total['sample'] / elapsed:.1f} "
                  f"samples/s; server RSS idle {idle_rss / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB "
                  f"(first half {first_half / 2**20:.0f}, second half {second_half / 2**20:.0f}); "
                  f"retrieve_future p50 {futures['retrieve_future']['p50_ms']} ms p99 "
                  f"{futures['retrieve_future']['p99_ms']} ms; submit-to-result p50 "
                  f"{futures['completion']['p50_ms']} ms p99 {futures['completion']['p99_ms']} ms")
    finally:
        server.stop()
