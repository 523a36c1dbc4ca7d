"""Unmodified tinker-cookbook recipes against the real server, each run as a subprocess exactly as a user would:
only the command-line config and ``TINKER_BASE_URL`` / ``TINKER_API_KEY`` are ours. The recipes load the tiny
model's tokenizer by its advertised name, offline, from the Hugging Face cache the server installed it into.

Asserted from what the recipes wrote: every step's metrics present and finite, and every checkpoint they recorded
listed by the server afterwards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import tinker

from tests.cookbook_env import cookbook_python
from tests.helpers import BASE_MODEL

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def python() -> Path:
    return cookbook_python()


def run_recipe(python: Path, server, key: str, module: str, log_path: Path, *config: str) -> list[dict]:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": key, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(python), "-m", module, f"log_path={log_path}", f"model_name={BASE_MODEL}",
                           "renderer_name=role_colon", "lora_rank=8", "behavior_if_log_dir_exists=delete", *config],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{module} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "Training completed successfully" in done.stdout + done.stderr
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def assert_checkpoints_listed(server, key: str, log_path: Path) -> int:
    """Every checkpoint the recipe recorded in checkpoints.jsonl is one the server lists for this key."""
    recorded = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    paths = {p for row in recorded for p in (row.get("state_path"), row.get("sampler_path")) if p}
    listed = {c.tinker_path for c in tinker.RestClient(base_url=server.base_url, api_key=key)
              .list_user_checkpoints(limit=1000).result().checkpoints}
    assert recorded and paths <= listed, (paths - listed)
    return len(recorded)


def finite(rows: list[dict], key: str) -> list[float]:
    values = [row[key] for row in rows if key in row]
    assert values and all(math.isfinite(v) for v in values), (key, values)
    return values


def test_supervised_learning_on_the_cookbooks_conversations(python, server, tmp_path):
    key = "tml-test-cookbook-sl"
    where = "import tinker_cookbook, os; print(os.path.dirname(tinker_cookbook.__file__))"
    data = subprocess.run([str(python), "-c", where], capture_output=True, text=True, check=True).stdout.strip()
    rows = run_recipe(python, server, key, "tinker_cookbook.recipes.chat_sl.train", tmp_path,
                      f"dataset={data}/example_data/conversations.jsonl", "batch_size=8", "max_length=512",
                      "learning_rate=1e-3", "max_steps=4", "eval_every=2", "save_every=2")
    nll = finite(rows, "train_mean_nll")
    assert len(nll) == 4  # one row per step
    finite(rows, "grad_norm")
    assert assert_checkpoints_listed(server, key, tmp_path) >= 2  # the periodic save and the final one


@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "importance_sampling", "ppo", "gspo"])
def test_math_rl_arithmetic(python, server, tmp_path, loss_fn):
    key = f"tml-test-cookbook-rl-{loss_fn}"
    extra = [] if loss_fn == "stable_reinforce" else [f"loss_fn={loss_fn}"]  # stable_reinforce is its default
    rows = run_recipe(python, server, key, "tinker_cookbook.recipes.math_rl.train", tmp_path, "env=arithmetic",
                      "group_size=4", "groups_per_batch=4", "max_steps=3", "learning_rate=1e-4", "eval_every=2",
                      "save_every=2", *extra)
    rewards = finite(rows, "env/all/reward/total")
    assert len(rewards) == 3
    finite(rows, "grad_norm")
    # The recipe measures sampler-vs-trainer KL on the sampled tokens: the two must agree (fp32 on CPU).
    assert max(abs(v) for v in finite(rows, "optim/kl_sample_train_v1")) < 1e-3
    assert assert_checkpoints_listed(server, key, tmp_path) >= 2
    if loss_fn == "stable_reinforce":  # its samples were recorded, and training found them by sequence id
        owner = hashlib.sha256(key.encode()).hexdigest()
        with sqlite3.connect(server.data_dir / "records.sqlite3") as db:
            recorded = db.execute("SELECT count(*) FROM stability_records WHERE owner = ?", [owner]).fetchone()[0]
        assert recorded >= 3 * 4 * 4  # steps × groups × group size
        run_id = json.loads((tmp_path / "checkpoints.jsonl").read_text().splitlines()[0])["state_path"].split("/")[2]
        assert any(run_id in line and "stable_reinforce loss:sum" in line for line in server.log().splitlines())


DPO_DRIVER = """
import sys
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

log_path, data, model = sys.argv[1:]
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon", max_length=256,
                                        batch_size=4)
train_dpo.main(train_dpo.Config(
    log_path=log_path, model_name=model, recipe_name="compat-server-test", renderer_name="role_colon",
    dataset_builder=DPODatasetBuilderFromComparisons(comparison_builder=ComparisonBuilderFromJsonl(train_path=data),
                                                     common_config=common),
    learning_rate=1e-3, dpo_beta=0.5, lora_rank=8, save_every=2, eval_every=0))
"""


def test_dpo_with_the_cookbooks_trainer(python, server, tmp_path):
    """tinker_cookbook.preference.train_dpo, unmodified, on comparisons from a local JSONL (its recipe CLI offers
    only Hugging Face datasets, which cannot be downloaded here): its DPO loss runs through forward_backward_custom
    (a plain function, so the SDK's client-side path), against a reference model it samples from."""
    rows = [{"comparison": {"prompt_conversation": [{"role": "user", "content": f"Say {word}."}],
                            "completion_A": [{"role": "assistant", "content": f"{word}!"}],
                            "completion_B": [{"role": "assistant", "content": "No."}]}, "label": "A"}
            for word in ["yes", "hello", "blue", "seven", "north", "tea", "rain", "moon"]]
    data = tmp_path / "comparisons.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": "tml-test-cookbook-dpo",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(python), "-c", DPO_DRIVER, str(tmp_path / "log"), str(data), BASE_MODEL], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"train_dpo failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    losses = finite(metrics, "dpo_loss")
    assert len(losses) == 2  # 16 datums (8 pairs), 4 per batch: two steps
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)  # policy = reference at the first step
    assert losses[-1] < losses[0]  # the step moved the policy toward the chosen answers
    assert assert_checkpoints_listed(server, "tml-test-cookbook-dpo", tmp_path / "log") >= 1
