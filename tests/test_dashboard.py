"""The dashboard in a real browser: headless Chromium (the Debian package) opens ``/`` with a key after a short
training run; the page must list that key's run, checkpoint and session (and nobody else's), and draw its loss curve,
which the screenshot must show."""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import numpy as np
import pytest
import tinker
from PIL import Image

from tests.helpers import BASE_MODEL, make_datum, train

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CURVE_BLUE = (37, 99, 235)  # the page's --accent, the loss curve's stroke


def _browse(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,900", "--virtual-time-budget=8000", *args, url],
                          check=True, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package `chromium`); .ci/run installs it")
def test_the_dashboard_shows_a_keys_runs_and_draws_their_loss_curve(server, tmp_path):
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-dashboard")
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=4).result()
    losses = train(client, make_datum([9, 8, 7], [6, 5, 4]), 6)
    path = client.save_state("for-the-dashboard").result().path

    data = httpx.get(f"{server.base_url}/api/v1/dashboard", headers={"X-API-Key": "tml-test-dashboard"}).json()
    (run,) = [r for r in data["training_runs"] if r["id"] == client.model_id]
    assert [step["loss"] for step in run["steps"]] == pytest.approx(losses, rel=1e-6)
    assert path in [c["tinker_path"] for c in data["checkpoints"]["latest"]]
    other = httpx.get(f"{server.base_url}/api/v1/dashboard", headers={"X-API-Key": "tml-test-someone-else"}).json()
    assert client.model_id not in str(other)  # scoped to the viewer's key
    anonymous = httpx.get(f"{server.base_url}/api/v1/dashboard")  # --auth open: the shared anonymous tenant's view
    assert anonymous.status_code == 200 and client.model_id not in anonymous.text

    page = f"{server.base_url}/#key=tml-test-dashboard"
    dom = _browse(page, "--dump-dom").stdout
    assert 'data-loaded="yes"' in dom, dom[:2000]
    assert client.model_id in dom and path in dom
    assert re.search(r'class="loss-curve"[^>]*data-points="6"', dom)
    shot = tmp_path / "dashboard.png"
    _browse(page, f"--screenshot={shot}")
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int32)
    blue = int((np.abs(pixels - np.array(CURVE_BLUE)).sum(axis=-1) < 60).sum())
    assert blue > 150, f"the loss curve was not drawn ({blue} curve-coloured pixels)"
    service.close("success")
