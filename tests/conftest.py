"""Shared fixtures: one built tiny model, and the real servers the whole run shares.

The suite runs in parallel where the machine has the cores for it (pytest-xdist, ``-n auto --dist loadfile`` in
pyproject.toml; ``pytest_xdist_auto_num_workers`` picks the workers, none on 2 cores): each test module runs in one
worker, so a module's own server starts once, and the session servers (``transformers_server``, ``vllm_server``,
``keyed_server``) start once for the whole run, in the first worker that needs one, and serve every worker
(``tests.server.shared_server``); the controller stops them when the run ends. The model cache and the servers'
registry are directories the controller makes before the workers start, so every worker finds them.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import psutil
import pytest

# Tests never touch a model hub; the tinker SDK's get_tokenizer() must resolve locally, from a Hugging Face cache of
# their own (the server installs the tiny model there under its name) rather than the user's.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_CACHE", tempfile.mkdtemp(prefix="compat-server-test-hf-"))
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.server import SERVER_ENV  # after the environment above

# Every server the suite starts holds its Ray object store resident from the start (--ray-object-store-mb, touched
# once); several run at once on the CI machine, and the tests' adapters are small: half the default each. Set in the
# servers' environment alone: the suite's own reading of the options keeps their defaults.
SERVER_ENV["COMPAT_SERVER_RAY_OBJECT_STORE_MB"] = "512"


REGISTRY_ENV = "COMPAT_SERVER_TEST_SERVERS"
"""The directory where the run's shared servers are recorded (``tests.server.shared_server``)."""

WORKER_MEMORY_GIB = 8.0
"""Memory one worker may need at its peak: its own test process (torch, the SDKs, reference models) and the servers
its modules start (a server with its Ray processes holds 1–3 GiB; the model-family modules host eight models at once)."""

CORES_PER_WORKER = 4
"""Cores one worker keeps busy: a server start is several processes importing torch, transformers and vLLM at once
(the server, its trainer and sampler actors, vLLM's engine and worker, Ray's own), and a test drives a server that
computes while the test process checks. Measured on 2 cores: in one process, 48 min; two workers, 53 min (every start slower)."""


def pytest_configure(config) -> None:
    """In the controller (or a run without workers): the directories every worker shares, made before they start."""
    if hasattr(config, "workerinput"):
        return
    os.environ.setdefault(REGISTRY_ENV, tempfile.mkdtemp(prefix="compat-server-test-servers-"))
    os.environ.setdefault("COMPAT_SERVER_TEST_CACHE", tempfile.mkdtemp(prefix="compat-server-test-cache-"))
    signal.signal(signal.SIGTERM, _interrupted)


def _interrupted(signum, frame) -> None:
    """A terminated run (``timeout``, CI's limit) ends as an interrupted one, so that ``pytest_unconfigure`` still
    stops the shared servers, which run in sessions of their own and would outlive it."""
    raise KeyboardInterrupt(f"terminated by signal {signum}")


def pytest_unconfigure(config) -> None:
    """The run is over (every worker has finished): stop the shared servers."""
    if hasattr(config, "workerinput") or REGISTRY_ENV not in os.environ:
        return
    from tests.server import stop_shared_servers

    stop_shared_servers(Path(os.environ[REGISTRY_ENV]))


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per ``CORES_PER_WORKER`` cores, fewer where memory would not hold them; 0 (no workers,
    the run in this process) on a machine too small for two, such as CI's 2 cores."""
    cores = len(os.sched_getaffinity(0))
    memory = psutil.virtual_memory().total / 2**30
    workers = min(cores // CORES_PER_WORKER, int(memory // WORKER_MEMORY_GIB))
    return workers if workers > 1 else 0


def pytest_collection_modifyitems(config, items) -> None:
    """The slowest modules go first, so that no worker is left with a long one at the end while the others idle
    (``--dist loadfile`` hands the workers whole modules in this order)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


SLOW_FIRST: tuple[str, ...] = (
    "test_reliability", "test_model_families", "test_fuzz", "test_sampling_sdk", "test_openai_sdk",
    "test_sharded_trainer", "test_vllm_families", "test_ray_cluster",
    "test_sampler_tensor_parallel", "test_telemetry", "test_openai_vllm_surface", "test_base_models",
    "test_vl_checkpoint")
"""Modules that take the longest, longest first (measured from CI's per-module durations): the order only, which
no test depends on."""


def pytest_terminal_summary(terminalreporter) -> None:
    """Each module's time (its tests' set-up, call and tear-down, servers started for it included), slowest first:
    what to look at when the run grows slow."""
    spent: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) and hasattr(report, "duration"):
                module = report.nodeid.split("::", 1)[0]
                spent[module] = spent.get(module, 0.0) + report.duration
    if spent:
        terminalreporter.section("time per module")
        for module, seconds in sorted(spent.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:8.1f} s  {module}")


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
               "--max-adapters", "256", "--max-adapters-per-key", "256")
"""Every other sample request is re-scored by the trainer, so the drift metric is exercised by the tests; TTLs down
to a second and a sweep every second let the expiry tests run in seconds. The shared servers host every module's
tenants for the whole run, and most clients stay open until it ends: more training runs are alive at once than one
trainer holds by default (64), many of them under one key (16 by default)."""


def _shared(name: str, start):
    from tests.server import shared_server

    return shared_server(Path(os.environ[REGISTRY_ENV]), name, start)


@pytest.fixture(scope="session")
def transformers_server(model_cache, tmp_path_factory):
    """The server most tests share: the default sampler backend on CPU (transformers). It runs without
    HF_HUB_OFFLINE, as a user would, so everything the tests do through it shows that the built-in model never
    sends the server to the hub (``test_cli_and_model`` reads its log for that). It says which modules it has
    imported when asked (``tests.serve``; ``test_server_imports``)."""
    from tests.server import start_server

    return _shared("transformers", lambda: start_server(tmp_path_factory.mktemp("server-data"), *SERVER_ARGS,
                                                         env={"HF_HUB_OFFLINE": "0"}, detached=True,
                                                         reports_modules=True))


@pytest.fixture(scope="session")
def vllm_server(model_cache, tmp_path_factory):
    """The same server with ``--sampler-backend vllm`` (vLLM's CPU build here), started once for every module whose
    tests run on both sampler backends."""
    from tests.helpers import skip_without_vllm
    from tests.server import start_server

    skip_without_vllm()
    return _shared("vllm", lambda: start_server(tmp_path_factory.mktemp("vllm-server-data"), "--sampler-backend",
                                                "vllm", *SERVER_ARGS, timeout=400, detached=True,
                                                reports_modules=True))


@pytest.fixture(scope="session")
def keyed_server(model_cache, tmp_path_factory):
    """A server with ``--auth keys`` and registered keys (name → key): ``alice`` and ``bob`` for the multi-tenant
    tests, ``revoked-soon`` for the revocation test, ``logs-out`` for ``tinker auth logout``,
    ``token-holder`` for a token outliving its key. Its expiry sweep runs hourly, so an expired checkpoint's files
    stay on disk and what refuses it is the check at use. It also runs ``--disable-any-whitespace`` (its constrained
    JSON is compact), which no other test of it reads, and ``--upload-ttl 30``, so an adapter upload's URLs expire
    within a test (``test_external_uploads``)."""
    from tests.helpers import keys_command
    from tests.server import start_server

    def start():
        data_dir = tmp_path_factory.mktemp("keyed-server")
        issued = {}
        for name in ("alice", "bob", "revoked-soon", "logs-out", "token-holder"):
            created = keys_command(data_dir, "create", "--name", name)
            assert created.returncode == 0, created.stderr
            issued[name] = created.stdout.strip()
        running = start_server(data_dir, "--auth", "keys", "--min-checkpoint-ttl", "1", "--expiry-sweep-seconds",
                               "3600", "--disable-any-whitespace", "--upload-ttl", "30", detached=True)
        running.extra["issued"] = issued
        return running

    running = _shared("keyed", start)
    return running, running.extra["issued"]


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
