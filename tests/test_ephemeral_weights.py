"""compat_server.sampling.ephemeral: unnamed sampler saves get an identity of their own (``EphemeralKey``), inflight
saves are new versions of one adapter, and only the last ``keep`` saves per training model stay on disk."""

from __future__ import annotations

from pathlib import Path

from compat_server.sampling.ephemeral import EphemeralKey, EphemeralWeights


def save(weights: EphemeralWeights, model_id: str, *, inflight: bool):
    directory = weights.directory(model_id)
    directory.mkdir(parents=True)
    return weights.add(model_id, directory, inflight=inflight)


def test_each_snapshot_is_its_own_adapter_and_inflight_saves_are_versions_of_one(tmp_path):
    weights = EphemeralWeights(tmp_path / "ephemeral", keep=8)
    first, second = save(weights, "s:train:0", inflight=False), save(weights, "s:train:0", inflight=False)
    assert first.key != second.key and first.version == second.version == 0
    assert first.key == str(EphemeralKey("s:train:0", Path(first.directory).name))
    assert weights.inflight("s:train:0") is None
    one, two = save(weights, "s:train:0", inflight=True), save(weights, "s:train:0", inflight=True)
    assert one.key == two.key == str(EphemeralKey.inflight("s:train:0")) and (one.version, two.version) == (1, 2)
    assert weights.inflight("s:train:0") == two
    assert save(weights, "s:train:1", inflight=True).key != two.key  # another model's inflight weights


def test_only_the_last_saves_per_model_stay_on_disk(tmp_path):
    weights = EphemeralWeights(tmp_path / "ephemeral", keep=2)
    refs = [save(weights, "m", inflight=False) for _ in range(3)]
    other = save(weights, "n", inflight=False)
    assert [Path(r.directory).exists() for r in refs] == [False, True, True]
    assert Path(other.directory).exists()
