"""``shared/reference/tinker_minimal.py``, unmodified, runs against the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "tinker_minimal.py"


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"reference script not found at {SCRIPT}")
def test_tinker_minimal_runs_up_to_sampling(server):
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": "tml-reference-script",
           "USE_TOKENIZER": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert "models: ['compat-server/tiny-qwen3']" in out, done.stderr[-3000:]
    steps = re.findall(r"step (\d): metrics=\{'loss:sum': ([0-9.]+)\}", out)
    assert [s for s, _ in steps] == ["0", "1", "2"], out + done.stderr[-3000:]
    assert re.search(r"state: tinker://\S+:train:0/weights/step-3", out)
    assert re.search(r"sampler weights: tinker://\S+:train:0/sampler_weights/step-3-sampler", out)
    # Sampling is the next slice of work: until it lands, the script stops at create_sampling_session.
    assert done.returncode != 0 and "create_sampling_session" in done.stderr
