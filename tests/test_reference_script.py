"""``shared/reference/tinker_minimal.py``, unmodified, runs to the end against the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "tinker_minimal.py"


@pytest.fixture(scope="module")
def server(backend_server):
    """The script runs against both sampler backends (``backend_server`` in conftest)."""
    return backend_server


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"reference script not found at {SCRIPT}")
@pytest.mark.parametrize("use_tokenizer", [False, True], ids=["token-ids", "USE_TOKENIZER=1"])
def test_tinker_minimal_runs_to_the_end(server, use_tokenizer):
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": "tml-reference-script",
           "HF_HUB_OFFLINE": "1",
           # if the script's process dies of a signal, every thread's Python stack is on its stderr (in the message)
           "PYTHONFAULTHANDLER": "1"}
    env.pop("USE_TOKENIZER", None)
    if use_tokenizer:
        env["USE_TOKENIZER"] = "1"
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    out = done.stdout
    assert done.returncode == 0, f"exit status {done.returncode}\n{out}\nstderr:\n{done.stderr[-6000:]}"
    assert "models: ['compat-server/tiny-qwen3']" in out
    steps = re.findall(r"step (\d): metrics=\{'loss:sum': ([0-9.]+)\}", out)
    assert [s for s, _ in steps] == ["0", "1", "2"], out
    losses = [float(loss) for _, loss in steps]
    assert losses[2] < losses[0], losses
    assert re.search(r"state: tinker://\S+:train:0/weights/step-3", out)
    assert re.search(r"sampler weights: tinker://\S+:train:0/sampler_weights/step-3-sampler", out)
    samples = re.findall(r"sample: (stop|length) \[([0-9, ]*)\] \[(.*)\]", out)
    assert len(samples) == 2, out
    for _, tokens, logprobs in samples:
        assert 1 <= len(tokens.split(",")) <= 8 and len(logprobs.split(",")) == min(3, len(tokens.split(",")))
    prompt_logprobs = re.search(r"prompt logprobs: \[None, (.*)\]", out)
    assert prompt_logprobs and all(float(v) < 0 for v in prompt_logprobs.group(1).split(","))
