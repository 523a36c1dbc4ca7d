"""Shared fixtures: one built tiny model, and one real server subprocess for the whole test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Tests never touch a model hub; the tinker SDK's get_tokenizer() must resolve locally, from a Hugging Face cache of
# their own (the server installs the tiny model there under its name) rather than the user's.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_CACHE", tempfile.mkdtemp(prefix="compat-server-test-hf-"))
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Build the tiny model once per test session and point every server at that cache."""
    from adapters.tiny_model import ensure_tiny_model

    cache = Path(os.environ.get("COMPAT_SERVER_TEST_CACHE") or tmp_path_factory.mktemp("model-cache"))
    os.environ["COMPAT_SERVER_CACHE"] = str(cache)
    ensure_tiny_model(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache) -> Path:
    from adapters.tiny_model import ensure_tiny_model

    return ensure_tiny_model(model_cache)


@pytest.fixture(scope="session")
def server(model_cache, tmp_path_factory):
    from tests.server import start_server

    # Every other sample request is re-scored by the trainer, so the drift metric is exercised by the tests; TTLs
    # down to a second and a sweep every second let the expiry tests run in seconds.
    running = start_server(tmp_path_factory.mktemp("server-data"), "--drift-probe-every", "2",
                           "--min-checkpoint-ttl", "1", "--expiry-sweep-seconds", "1")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def service_client(server):
    import tinker

    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test-main")
    yield client
    client.close("success")
