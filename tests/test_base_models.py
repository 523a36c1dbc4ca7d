"""Several base models on one server, one of them given as a local directory, each with its own trainer."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tinker

from tests.helpers import BASE_MODEL, forward_logprobs, make_datum, train
from tests.server import start_server


@pytest.fixture(scope="module")
def two_model_server(model_cache, tiny_model_dir, tmp_path_factory):
    local_copy = tmp_path_factory.mktemp("local-model") / "my-model"
    shutil.copytree(tiny_model_dir, local_copy)
    running = start_server(tmp_path_factory.mktemp("two-models"), "--base-model", BASE_MODEL,
                           "--base-model", str(local_copy))
    yield running, str(local_copy)
    running.stop()


def test_a_local_directory_serves_like_the_builtin_model(two_model_server):
    server, local = two_model_server
    caps = tinker.RestClient(base_url=server.base_url, api_key="tml-two").get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE_MODEL, local]

    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-two")
    on_local = service.create_lora_training_client(base_model=local, rank=4, seed=8).result()
    on_builtin = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8).result()
    info = on_local.get_info()
    assert info.model_data.model_name == local and info.model_data.tokenizer_id == local
    assert on_local.get_tokenizer().encode("hello") == on_builtin.get_tokenizer().encode("hello")

    # Same weights, same seed, same data: the two trainers (separate actors) agree step for step.
    datum = make_datum([3, 4, 5, 6], [7, 8])
    assert train(on_local, datum, 3) == pytest.approx(train(on_builtin, datum, 3), abs=1e-6)
    np.testing.assert_allclose(forward_logprobs(on_local, datum), forward_logprobs(on_builtin, datum), atol=1e-6)

    # A checkpoint of one base model cannot be loaded onto a model of the other.
    state = on_local.save_state("local-state").result().path
    with pytest.raises(tinker.RequestFailedError, match="was trained on"):
        service.create_training_client_from_state(state, base_model=BASE_MODEL).result()
    service.close("success")


def test_the_ready_line_and_lifecycle_logs_are_readable(two_model_server):
    server, local = two_model_server
    log = server.log()
    assert f"compat-server ready at {server.base_url} — base models: {BASE_MODEL}, {local}" in log
    assert "model created:" in log and "forward_backward done:" in log and "tokens/s" in log
    assert "checkpoint saved: tinker://" in log


def test_the_tiny_model_installs_into_a_hugging_face_cache_by_name(tiny_model_dir, tmp_path, monkeypatch):
    """A snapshot plus refs/main, as the hub client leaves them: loadable by repo id offline, idempotent."""
    from huggingface_hub import constants
    from transformers import AutoTokenizer

    from adapters.models.tiny import TINY_MODEL_NAME, install_in_hf_cache

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = install_in_hf_cache(tiny_model_dir, TINY_MODEL_NAME)
    assert install_in_hf_cache(tiny_model_dir, TINY_MODEL_NAME) == snapshot  # a second install changes nothing
    repo = tmp_path / "models--compat-server--tiny-qwen3"
    assert (repo / "refs" / "main").read_text() == snapshot.name
    by_name = AutoTokenizer.from_pretrained(TINY_MODEL_NAME, cache_dir=str(tmp_path), local_files_only=True)
    by_path = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert by_name.encode("héllo Paris") == by_path.encode("héllo Paris")
