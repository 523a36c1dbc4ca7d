"""compat_server.sampling.ephemeral: unnamed sampler saves get an identity of their own (``EphemeralKey``), inflight
saves are new versions of one adapter, and only the last ``keep`` saves per training model are kept, on disk or in
memory."""

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
    assert first.key == str(EphemeralKey.snapshot("s:train:0", Path(first.directory).name))
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


def test_saves_held_in_memory_are_found_by_key_and_only_the_last_kept(tmp_path):
    """Held in memory (``tensors``: what the server's Ray object reference would be), no directory made: a snapshot
    is found by its key until ``keep`` newer saves of its model push it out; inflight weights keep one version."""
    weights = EphemeralWeights(tmp_path / "ephemeral", keep=2, memory_bytes=1000)
    snapshots = [weights.add("m", tensors=f"weights {i}", nbytes=10, inflight=False) for i in range(3)]
    assert [r.directory for r in snapshots] == ["", "", ""]
    assert len({r.key for r in snapshots}) == 3
    assert [weights.snapshot(r.key) for r in snapshots] == [None, snapshots[1], snapshots[2]]
    assert weights.snapshot(snapshots[2].key).tensors == "weights 2"
    one = weights.add("m", tensors="inflight 1", nbytes=10, inflight=True)
    two = weights.add("m", tensors="inflight 2", nbytes=10, inflight=True)
    assert (one.key, one.version, two.version) == (two.key, 1, 2)
    assert weights.inflight("m").tensors == "inflight 2"
    # The replaced inflight version went at once; the newest snapshot and inflight weights are the two kept.
    assert weights.snapshot(snapshots[2].key) is snapshots[2]
    assert weights.snapshot(snapshots[1].key) is None
    assert list((tmp_path / "ephemeral").iterdir()) == []


def test_saves_held_in_memory_stay_within_their_bytes_oldest_out_first(tmp_path):
    """``--ephemeral-memory-mb`` over every training model's saves: a new save pushes out the oldest held ones, of
    any model — a model's inflight weights too, which are then gone (not an older version); a save larger than the
    whole budget does not fit (the server writes it as files)."""
    weights = EphemeralWeights(tmp_path / "ephemeral", keep=8, memory_bytes=100)
    assert weights.fits(100) and not weights.fits(101)
    a = weights.add("a", tensors="a0", nbytes=40, inflight=False)
    b = weights.add("b", tensors="b0", nbytes=40, inflight=True)
    assert weights.snapshot(a.key) is a and weights.inflight("b") is b
    c = weights.add("c", tensors="c0", nbytes=30, inflight=False)  # 110 > 100: a goes
    assert weights.snapshot(a.key) is None and weights.inflight("b") is b and weights.snapshot(c.key) is c
    b2 = weights.add("b", tensors="b1", nbytes=60, inflight=True)  # replaces b (40): 30 + 60 fits
    assert weights.inflight("b") is b2 and weights.snapshot(c.key) is c
    weights.add("d", tensors="d0", nbytes=50, inflight=False)  # c then b's inflight weights go
    assert weights.snapshot(c.key) is None and weights.inflight("b") is None


def test_a_model_makes_room_from_its_own_saves_first_and_versions_never_repeat(tmp_path):
    """A model's new save pushes out its own older saves before another tenant's; and once its inflight weights were
    pushed out, its next inflight save is a newer version still (a replica holding the old version reloads), not
    version 1 again (which that replica would take for the one it holds)."""
    weights = EphemeralWeights(tmp_path / "ephemeral", keep=8, memory_bytes=100)
    other = weights.add("other", tensors="o", nbytes=40, inflight=False)
    mine = weights.add("mine", tensors="m0", nbytes=40, inflight=False)
    newer = weights.add("mine", tensors="m1", nbytes=40, inflight=False)  # 120 > 100: mine's own older save goes
    assert weights.snapshot(other.key) is other and weights.snapshot(mine.key) is None
    assert weights.snapshot(newer.key) is newer
    first = weights.add("b", tensors="b1", nbytes=20, inflight=True)
    for i in range(3):  # b's inflight weights are pushed out by others' saves
        weights.add(f"flood{i}", tensors="x", nbytes=100, inflight=False)
    assert weights.inflight("b") is None
    again = weights.add("b", tensors="b2", nbytes=20, inflight=True)
    assert again.version > first.version


def test_a_run_whose_save_did_not_fit_is_written_at_once_next_time(tmp_path):
    """``may_hold``: no memory at all (``--ephemeral-memory-mb 0``) is never tried; a run whose last save was larger
    than the budget is written as files without an in-memory copy first; others are tried."""
    assert not EphemeralWeights(tmp_path / "none", keep=8, memory_bytes=0).may_hold("m")
    weights = EphemeralWeights(tmp_path / "ephemeral", keep=8, memory_bytes=100)
    assert weights.may_hold("m") and weights.may_hold("n")
    weights.sized("m", 101)
    weights.sized("n", 100)
    assert not weights.may_hold("m") and weights.may_hold("n")
