"""tinker-cookbook's weight tools (``tinker_cookbook.weights``) against the real server, run in the recipe environment
as a user runs them: ``download`` of a training checkpoint (which the cookbook exports through
``save_weights_external`` encrypted to an age key it generates, and decrypts), ``download`` of an export encrypted to
the user's own age key, and ``build_hf_model``, whose merged model must score like the adapter applied with PEFT and
like the server, on a model with tied embeddings and on one without.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyrage
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.cookbook_env import cookbook_python
from tests.helpers import (
    BASE_MODEL,
    checkpoint_dir,
    expect_user_error,
    forward_logprobs,
    make_datum,
    reference_logprobs,
    reference_peft_model,
    train,
)
from tests.server import start_server

pytestmark = pytest.mark.timeout(900)

KEY = "tml-test-cookbook-weights"
DATUM = make_datum([1, 2, 3, 4], [5, 6, 7])
FAST = types.AdamParams(learning_rate=1e-2)
"""A few steps at this rate move every LoRA weight, the unembedding's included, well away from the base model."""
PLAIN_FILES = ["adapter_config.json", "adapter_model.safetensors"]

SSH_RECIPIENT = ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJg/T0yITpkcqt5UilVRAiNMn1F9IclDyu5OfbRGV1uK "
                 "compat-server-test")
"""A well-formed SSH public key whose private half was thrown away: SSH recipients are accepted beside age ones."""

DOWNLOAD = ("import sys; from tinker_cookbook import weights; "
            "weights.download(tinker_path=sys.argv[1], output_dir=sys.argv[2])")
EXPORT = ("import sys; from tinker_cookbook import weights; state, adapter, base, merged, peft = sys.argv[1:]; "
          "weights.download(tinker_path=state, output_dir=adapter); "
          "weights.build_hf_model(base_model=base, adapter_path=adapter, output_path=merged); "
          "peft and weights.build_lora_adapter(base_model=base, adapter_path=adapter, output_path=peft)")
"""The cookbook's three steps, in one process (each process spends seconds importing the cookbook): ``weights.download``
of a training checkpoint, ``build_hf_model`` merging it into the base model, and (unless ``peft`` is empty)
``build_lora_adapter`` converting it for vLLM / SGLang."""


@pytest.fixture(scope="module")
def python() -> Path:
    return cookbook_python()


def run_cookbook(python: Path, server, code: str, *args: str) -> None:
    """``code`` in the recipe environment, configured only as a user would: ``TINKER_BASE_URL``, ``TINKER_API_KEY``."""
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(python), "-c", code, *args], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def trained_run(server, base_model: str):
    """A service client and a run on ``base_model`` trained a few steps, LoRA on every module the unembedding too."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    run = client.create_lora_training_client(base_model=base_model, rank=4, seed=11).result()
    train(run, DATUM, 3, FAST)
    return client, run


@pytest.fixture(scope="module")
def trained(server):
    client, run = trained_run(server, BASE_MODEL)
    yield run, tinker.RestClient(base_url=server.base_url, api_key=KEY)
    client.close("success")


HOSTED_HEAD, STORED_HEAD = "base_model.model.model.unembed_tokens.", "base_model.model.lm_head."


def hosted_names(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What hosted Tinker exports for a stored (PEFT-named) adapter: the unembedding LoRA once, as
    ``model.unembed_tokens``, without the copy a tied model's stored adapter keeps on the embedding."""
    return {k.replace(STORED_HEAD, HOSTED_HEAD): v for k, v in stored.items() if ".embed_tokens." not in k}


def check_download_and_merge(python, server, run, base_dir: Path, tmp_path: Path) -> None:
    """The cookbook downloads a training checkpoint (an export encrypted to a fresh key, decrypted, the export
    deleted) and gets the saved adapter in hosted Tinker's naming; ``build_hf_model`` merges it into a model whose
    logits are those of the stored adapter applied by PEFT, and of the server's own forward pass."""
    state = run.save_state("to-merge").result().path
    adapter, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    run_cookbook(python, server, EXPORT, state, str(adapter), str(base_dir), str(merged_dir), "")
    assert sorted(p.name for p in adapter.iterdir()) == PLAIN_FILES
    stored = load_file(checkpoint_dir(server.data_dir, state) / "adapter_model.safetensors")
    downloaded = load_file(adapter / "adapter_model.safetensors")
    expected_tensors = hosted_names(stored)
    assert downloaded.keys() == expected_tensors.keys()
    assert all(torch.equal(downloaded[k], expected_tensors[k]) for k in downloaded)
    assert downloaded[f"{HOSTED_HEAD}lora_B.weight"].abs().max() > 1e-3  # the unembedding LoRA was trained

    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 40, 90, 300]])
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    reference = reference_peft_model(base_dir, checkpoint_dir(server.data_dir, state))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        with reference.disable_adapter():
            base = reference(input_ids=tokens).logits
        got = merged(input_ids=tokens).logits
        merged_logprobs = reference_logprobs(merged, DATUM).numpy()
    assert (expected - base).abs().max() > 1e-2  # the adapter moves the logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(forward_logprobs(run, DATUM), merged_logprobs, atol=1e-4)


def test_a_tied_model_s_checkpoint_downloads_and_merges_into_the_trained_model(python, server, trained,
                                                                               tiny_model_dir, tmp_path):
    """The tiny model ties its input embedding to its output head; the unembedding LoRA changes that one matrix, and
    the cookbook merges hosted Tinker's ``unembed_tokens`` into it — which must give the model the server trained."""
    run, rest = trained
    check_download_and_merge(python, server, run, tiny_model_dir, tmp_path)
    kinds = {c.checkpoint_type for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    assert "external" not in kinds  # the temporary export was deleted


def test_an_export_encrypted_to_recipients_opens_only_with_their_identity(python, server, trained, tmp_path):
    run, rest = trained
    mine = pyrage.x25519.Identity.generate()
    sealed = run.save_weights_external("sealed", age_encryption_recipients=[str(mine.to_public()),
                                                                             SSH_RECIPIENT]).result().path
    plain = run.save_weights_external("plain").result().path  # the same weights, unencrypted, to compare with
    encrypted_names = [f"{name}.age" for name in PLAIN_FILES]
    # Nothing unencrypted is stored, so nothing unencrypted can be handed a URL.
    assert sorted(p.name for p in checkpoint_dir(server.data_dir, sealed).iterdir()) == encrypted_names
    assert sorted(rest.get_external_weights_urls(sealed).result().urls) == encrypted_names
    with pytest.raises(tinker.BadRequestError, match="age-encrypted export"):  # not a 500 naming server paths
        rest.get_weights_info_by_tinker_path(sealed).result()

    out = tmp_path / "sealed"
    run_cookbook(python, server, DOWNLOAD, sealed, str(out))
    assert sorted(p.name for p in out.iterdir()) == encrypted_names  # the cookbook leaves them as they are
    someone_else = pyrage.x25519.Identity.generate()
    for name in PLAIN_FILES:
        ciphertext = (out / f"{name}.age").read_bytes()
        assert ciphertext.startswith(b"age-encryption.org/v1\n")
        assert pyrage.decrypt(ciphertext, [mine]) == (checkpoint_dir(server.data_dir, plain) / name).read_bytes()
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(ciphertext, [someone_else])


def test_bad_recipients_are_user_errors_that_say_what_is_wrong(trained):
    run, rest = trained
    valid = str(pyrage.x25519.Identity.generate().to_public())
    for recipients, message in [
        ([valid, "age1notakey"], "age_encryption_recipients[1] is not a valid age recipient"),
        (["ssh-ed25519 AAAA"], "age_encryption_recipients[0] is not a valid age recipient"),
        (["age1" + "q" * 5000], "age_encryption_recipients[0] is 5004 characters long"),
        ([valid] * 11, "at most 10"),
        ([], "age_encryption_recipients is empty"),
    ]:
        expect_user_error(run.save_weights_external("refused", age_encryption_recipients=recipients), message)
    listed = {c.tinker_path for c in rest.list_checkpoints(run.model_id).result().checkpoints}
    assert not any(path.endswith("/refused") for path in listed)
    # The run's calls stay in order: the next save goes through.
    assert run.save_weights_external("accepted", age_encryption_recipients=[valid]).result().path.endswith(
        "/external_weights/accepted")


@pytest.fixture(scope="module")
def untied_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with an output head of its own (``tie_word_embeddings`` false): the embedding plus a little
    noise, so a delta merged into the wrong one of the two would show."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("untied") / "tiny-qwen3-untied"
    shutil.copytree(tiny_model_dir, directory, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(7)) * 0.01
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() + noise)
    model.config.tie_word_embeddings = False
    model.save_pretrained(str(directory))
    assert "lm_head.weight" in load_file(directory / "model.safetensors")
    return directory


@pytest.fixture(scope="module")
def untied_server(model_cache, untied_model, tmp_path_factory):
    """A server serves its base models from start-up, so the untied model gets a server of its own."""
    running = start_server(tmp_path_factory.mktemp("untied-server"), "--base-model", str(untied_model))
    yield running
    running.stop()


def test_an_untied_model_s_checkpoint_downloads_and_merges_into_the_trained_model(python, untied_server,
                                                                                   untied_model, tmp_path):
    """With an output head of its own, the merge puts ``unembed_tokens`` into ``lm_head`` and leaves the input
    embedding as it was."""
    client, run = trained_run(untied_server, str(untied_model))
    try:
        check_download_and_merge(python, untied_server, run, untied_model, tmp_path)
    finally:
        client.close("success")
