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


def pytest_report_header(config) -> str:
    """The SDK and engine versions this run tests against, and where they differ from the lock."""
    from tests.install_lock import wire_facing_summary

    return "wire-facing packages: " + wire_facing_summary()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Build the tiny model once per test session and point every server at that cache."""
    from adapters.models.tiny import ensure_tiny_model

    cache = Path(os.environ.get("COMPAT_SERVER_TEST_CACHE") or tmp_path_factory.mktemp("model-cache"))
    os.environ["COMPAT_SERVER_CACHE"] = str(cache)
    ensure_tiny_model(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache) -> Path:
    from adapters.models.tiny import ensure_tiny_model

    return ensure_tiny_model(model_cache)


SERVER_ARGS = ("--drift-probe-every", "2", "--min-checkpoint-ttl", "1", "--expiry-sweep-seconds", "1",
               "--max-adapters", "256")
"""Every other sample request is re-scored by the trainer, so the drift metric is exercised by the tests; TTLs down
to a second and a sweep every second let the expiry tests run in seconds. The shared servers host every module's
tenants for the whole run, and most clients stay open until it ends: more training runs are alive at once than one
trainer holds by default (64)."""


@pytest.fixture(scope="session")
def transformers_server(model_cache, tmp_path_factory):
    """The server most tests share: the default sampler backend on CPU (transformers). It runs without
    HF_HUB_OFFLINE, as a user would, so everything the tests do through it shows that the built-in model never
    sends the server to the hub (``test_cli_and_model`` reads its log for that)."""
    from tests.server import start_server

    running = start_server(tmp_path_factory.mktemp("server-data"), *SERVER_ARGS, env={"HF_HUB_OFFLINE": "0"})
    yield running
    running.stop()


@pytest.fixture(scope="session")
def vllm_server(model_cache, tmp_path_factory):
    """The same server with ``--sampler-backend vllm`` (vLLM's CPU build here), started once for every module whose
    tests run on both sampler backends."""
    from tests.helpers import skip_without_vllm
    from tests.server import start_server

    skip_without_vllm()
    running = start_server(tmp_path_factory.mktemp("vllm-server-data"), "--sampler-backend", "vllm", *SERVER_ARGS,
                           timeout=400)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def keyed_server(model_cache, tmp_path_factory):
    """A server with ``--auth keys`` and registered keys (name → key): ``alice`` and ``bob`` for the multi-tenant
    tests, ``revoked-soon`` for the revocation test, ``logs-out`` for ``tinker auth logout``,
    ``token-holder`` for a token outliving its key. Its expiry sweep runs hourly, so an expired checkpoint's files
    stay on disk and what refuses it is the check at use. It also runs ``--disable-any-whitespace`` (its constrained
    JSON is compact), which no other test of it reads."""
    from tests.helpers import keys_command
    from tests.server import start_server

    data_dir = tmp_path_factory.mktemp("keyed-server")
    issued = {}
    for name in ("alice", "bob", "revoked-soon", "logs-out", "token-holder"):
        created = keys_command(data_dir, "create", "--name", name)
        assert created.returncode == 0, created.stderr
        issued[name] = created.stdout.strip()
    running = start_server(data_dir, "--auth", "keys", "--min-checkpoint-ttl", "1", "--expiry-sweep-seconds", "3600",
                           "--disable-any-whitespace")
    yield running, issued
    running.stop()


@pytest.fixture(scope="session")
def server(transformers_server):
    return transformers_server


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def backend_server(request):
    """For a module that runs its tests on both sampler backends: it overrides ``server`` with this fixture (and
    ``service_client`` with one made by ``service_client_for``), so each of its tests runs once per backend."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(scope="session")
def service_client(server):
    from tests.helpers import service_client_for

    yield from service_client_for(server)
