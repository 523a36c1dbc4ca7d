"""The Docker image, built and run with podman on this machine, driven by the real tinker and openai SDKs.

No Docker daemon or image registry is reachable here, so the Debian base image is made with debootstrap and imported,
and the CPU torch wheel comes from this machine's wheel directory when there is one. The job takes about eight
minutes on 2 cores, so this test runs only when asked: ``.ci/container`` installs podman and debootstrap and runs it
(``COMPAT_SERVER_CONTAINER_TEST=1``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.helpers import BASE_MODEL, make_datum, train
from tests.server import free_port

pytestmark = pytest.mark.skipif(
    os.environ.get("COMPAT_SERVER_CONTAINER_TEST") != "1" or shutil.which("podman") is None,
    reason="building and running the image takes ~8 minutes: run .ci/container (installs podman and debootstrap, then runs "
           "this test with COMPAT_SERVER_CONTAINER_TEST=1)")

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "localhost/compat-server-debian:bookworm"
IMAGE = "localhost/compat-server:test"
WHEELS = Path("/opt/wheels")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _base_image() -> None:
    """A minimal Debian bookworm image made with debootstrap (no registry to pull one from)."""
    if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return
    rootfs = Path(os.environ.get("COMPAT_SERVER_ROOTFS", "/var/tmp/compat-server-rootfs"))
    if not (rootfs / "usr/bin/apt-get").exists():
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), "http://deb.debian.org/debian"],
                       check=True, capture_output=True, timeout=1200)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True,
                   timeout=600)
    tar.wait()


@pytest.fixture(scope="module")
def image():
    _base_image()
    local_torch = WHEELS.is_dir() and any(WHEELS.glob("torch-2.13.0+cpu-*.whl"))
    args = ["build", "--format", "docker", "--network", "host", "--runtime", "runc", "--target", "cpu",
            "--build-arg", f"BASE={BASE_IMAGE}", "-t", IMAGE]
    if local_torch:  # this machine has the CPU wheel but cannot reach download.pytorch.org
        args += ["--volume", f"{WHEELS}:/wheels:ro", "--build-arg", "WHEELS_DIR=/wheels",
                 "--build-arg", "TORCH_INDEX_URL="]
    if HOST_CA.is_file():  # the host's CA bundle, which trusts any HTTPS proxy between here and the registry
        args += ["--volume", f"{HOST_CA}:/etc/host-ca.crt:ro", "--build-arg", "CA_BUNDLE=/etc/host-ca.crt"]
    started = time.monotonic()
    built = podman(*args, str(ROOT), timeout=2400, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    print(f"\nimage built in {time.monotonic() - started:.0f} s, {size / 2**30:.2f} GiB")
    return IMAGE


@pytest.mark.timeout(3600)
def test_the_image_serves_the_tinker_and_openai_sdks_as_a_non_root_user_and_keeps_its_data(image):
    port = free_port()
    volume = f"compat-test-{uuid.uuid4().hex[:8]}"
    podman("volume", "create", volume)
    name = f"compat-test-{uuid.uuid4().hex[:8]}"

    def run_container() -> None:
        # `docker run -p`: the image listens on its default port 8000, published on a free port of the host's loopback
        # (slirp4netns, podman's user-space network: the bridge network needs firewall rights a CI box may lack).
        podman("run", "-d", "--rm", "--runtime", "runc", "--network", "slirp4netns", "-p", f"127.0.0.1:{port}:8000",
               "--shm-size", "1g", "--name", name, "-v", f"{volume}:/data", "-e", "COMPAT_SERVER_RAY_NUM_CPUS=2",
               image)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            logs = podman("logs", name, check=False)
            assert time.monotonic() < deadline, logs.stdout[-3000:] + logs.stderr[-3000:]
            time.sleep(2)

    try:
        run_container()
        url = f"http://127.0.0.1:{port}"
        assert podman("exec", name, "id", "-u").stdout.strip() == "1000"  # not root
        assert podman("healthcheck", "run", name, check=False).returncode == 0
        # Listening on 0.0.0.0, the image defaults to registered keys only.
        assert httpx.get(f"{url}/api/v1/training_runs", headers={"X-API-Key": "tml-unregistered"}).status_code == 401
        key = podman("exec", name, "compat-server", "keys", "create", "--name", "test").stdout.strip()
        assert key.startswith("tml-")

        service = tinker.ServiceClient(base_url=url, api_key=key)
        client = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
        datum = make_datum([11, 42, 77], [250, 3, 99])
        losses = train(client, datum, 20)
        assert losses[-1] < losses[0] / 2
        path = client.save_weights_for_sampler("in-container").result().path
        sampler = service.create_sampling_client(model_path=path).result()
        greedy = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
        assert sampler.sample(types.ModelInput.from_ints([11, 42, 77]), 1, greedy).result().sequences[0].tokens == \
            [250, 3, 99]
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
        reply = chat.chat.completions.create(model=path, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens > 0
        service.close("success")

        # The data volume outlives the container: a new one lists the same checkpoint.
        podman("stop", "-t", "30", name, timeout=90)
        run_container()
        rest = tinker.RestClient(base_url=url, api_key=key)
        listed = rest.list_user_checkpoints().result()
        assert path in [c.tinker_path for c in listed.checkpoints]
    finally:
        podman("rm", "-f", name, check=False)
        podman("volume", "rm", "-f", volume, check=False)
