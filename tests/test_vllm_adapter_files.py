"""``adapters.samplers.vllm.adapter_files``: weights handed in memory become a PEFT directory in shared memory for
vLLM to read (falling back, with a warning, where shared memory has no room), and ranks are checked before loading."""

from __future__ import annotations

import json
import logging
from collections import namedtuple

import numpy as np
import pytest
from safetensors.numpy import load_file

from adapters.lora.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from adapters.samplers.interface import PeftTensors
from adapters.samplers.vllm import adapter_files
from shims.errors import UserError

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {}, "alpha_pattern": {}}


def weights() -> PeftTensors:
    rng = np.random.default_rng(0)
    full = rng.standard_normal((8, 16), dtype=np.float32)
    return PeftTensors({"base_model.model.q_proj.lora_A.weight": full[:4],
                        "base_model.model.q_proj.lora_B.weight": full[:, ::4]},  # not contiguous, as a view may be
                       CONFIG)


def test_handed_weights_are_written_as_the_peft_directory_in_shared_memory(tmp_path):
    handed = weights()
    directory = adapter_files.written(handed, "k", shared_memory=tmp_path)
    assert directory.parent == tmp_path
    state = load_file(str(directory / ADAPTER_WEIGHTS))
    assert state.keys() == handed.state.keys()
    for name, array in handed.state.items():
        np.testing.assert_array_equal(state[name], array)
    assert json.loads((directory / ADAPTER_CONFIG).read_text()) == CONFIG


def test_without_room_in_shared_memory_the_directory_goes_elsewhere_and_says_so(tmp_path, monkeypatch, caplog):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(adapter_files.shutil, "disk_usage", lambda _path: usage(2**26, 2**26 - 2**20, 2**20))
    monkeypatch.setattr(adapter_files.tempfile, "tempdir", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    shared = tmp_path / "shm"
    shared.mkdir()
    with caplog.at_level(logging.WARNING, logger="compat_server.sampler"):
        directory = adapter_files.written(weights(), "tenant-a:run", shared_memory=shared)
    assert directory.parent == tmp_path / "elsewhere" and list(shared.iterdir()) == []
    assert "do not fit" in caplog.text and "--shm-size" in caplog.text and "tenant-a:run" in caplog.text


def test_a_failed_write_leaves_no_directory(tmp_path):
    broken = PeftTensors({"a": np.zeros((2, 2), dtype=object)}, CONFIG)  # safetensors cannot hold objects
    with pytest.raises(Exception):  # noqa: B017 - whatever safetensors raises
        adapter_files.written(broken, "k", shared_memory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_ranks_are_checked_before_loading():
    adapter_files.check_rank("k", CONFIG, max_rank=4)
    with pytest.raises(UserError, match="rank 8 of k exceeds this sampler's --max-lora-rank 4"):
        adapter_files.check_rank("k", {**CONFIG, "rank_pattern": {"qkv_proj": 8}}, max_rank=4)
    with pytest.raises(UserError, match="no valid rank"):
        adapter_files.check_rank("k", {"lora_alpha": 8}, max_rank=4)
