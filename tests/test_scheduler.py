"""Per-model seq_id ordering, idempotent resubmission and error categories of the scheduler."""

from __future__ import annotations

import asyncio
import json

import pytest

from compat_server.jobs.futures import JSON, FutureHub, Payload
from compat_server.jobs.scheduler import Scheduler
from compat_server.records import SCHEMA_VERSION, Records
from shims.errors import UserError


@pytest.fixture
def hub(tmp_path):
    return FutureHub(Records(tmp_path / "records.sqlite3"))


def run(coro):
    return asyncio.run(coro)


def recorder(log: list, label: str, delay: float = 0.0):
    async def job() -> Payload:
        await asyncio.sleep(delay)
        log.append(label)
        return Payload(JSON, json.dumps({"label": label}).encode())
    return job


def test_jobs_run_in_seq_order_per_model_whatever_the_arrival_order(hub):
    async def scenario():
        scheduler = Scheduler(hub, trainers=None, gap_timeout=30)
        log: list[str] = []
        ids = {}
        for seq in (3, 1, 4, 2):
            ids[seq] = scheduler.submit(owner="o", kind="k", job=recorder(log, f"a{seq}", 0.01), model_id="a",
                                        seq_id=seq)
        ids["b"] = scheduler.submit(owner="o", kind="k", job=recorder(log, "b1"), model_id="b", seq_id=1)
        for request_id in ids.values():
            row = await hub.wait(request_id, "o", 5)
            assert row["state"] == "complete"
        return log

    log = run(scenario())
    assert [x for x in log if x.startswith("a")] == ["a1", "a2", "a3", "a4"]
    assert "b1" in log


def test_a_missing_seq_id_stalls_its_model_only_until_the_gap_timeout(hub):
    async def scenario():
        scheduler = Scheduler(hub, trainers=None, gap_timeout=0.3)
        log: list[str] = []
        later = scheduler.submit(owner="o", kind="k", job=recorder(log, "a2"), model_id="a", seq_id=2)
        assert (await hub.wait(later, "o", 0.1))["state"] == "pending"
        assert (await hub.wait(later, "o", 2))["state"] == "complete"
        return log

    assert run(scenario()) == ["a2"]


def test_resubmission_with_the_same_idempotency_key_runs_once(hub):
    async def scenario():
        scheduler = Scheduler(hub, trainers=None, gap_timeout=5)
        log: list[str] = []
        first = scheduler.submit(owner="o", kind="k", job=recorder(log, "x"), model_id="a", seq_id=1,
                                 idempotency_key="retry-1")
        second = scheduler.submit(owner="o", kind="k", job=recorder(log, "x"), model_id="a", seq_id=1,
                                  idempotency_key="retry-1")
        other_tenant = scheduler.submit(owner="p", kind="k", job=recorder(log, "y"), model_id="c", seq_id=1,
                                        idempotency_key="retry-1")
        await hub.wait(first, "o", 5)
        await hub.wait(other_tenant, "p", 5)
        return first, second, other_tenant, log

    first, second, other, log = run(scenario())
    assert first == second and other != first
    assert sorted(log) == ["x", "y"]


def test_a_resubmitted_turn_gets_the_same_future_and_a_used_turn_is_refused(hub):
    async def scenario():
        scheduler = Scheduler(hub, trainers=None, gap_timeout=0.2)
        log: list[str] = []
        waiting = scheduler.submit(owner="o", kind="k", job=recorder(log, "a2"), model_id="a", seq_id=2)
        again = scheduler.submit(owner="o", kind="k", job=recorder(log, "a2-again"), model_id="a", seq_id=2)
        assert again == waiting
        await hub.wait(waiting, "o", 3)  # seq 1 never came: skipped after the gap timeout
        late_skipped = scheduler.submit(owner="o", kind="k", job=recorder(log, "a1-late"), model_id="a", seq_id=1)
        reused = scheduler.submit(owner="o", kind="k", job=recorder(log, "a2-reused"), model_id="a", seq_id=2)
        return log, await hub.wait(late_skipped, "o", 3), await hub.wait(reused, "o", 3)

    log, late, reused = run(scenario())
    assert log == ["a2", "a1-late"]
    assert late["state"] == "complete"
    assert (reused["state"], reused["category"]) == ("failed", "user") and "already used" in reused["error"]


def test_futures_left_pending_by_a_previous_process_fail_as_server_errors(tmp_path):
    records = Records(tmp_path / "r.sqlite3")
    records.futures.create_future("req-1", owner="o", model_id="m", seq_id=1, kind="k", idempotency_key=None)
    records.runs.create_model("m", session_id="s", owner="o", base_model="b", lora={"rank": 4}, user_metadata=None)
    restarted = Records(tmp_path / "r.sqlite3")
    assert restarted.runs.recover_after_restart() == (1, 1)
    row = restarted.futures.future("req-1", "o")
    assert (row["state"], row["category"]) == ("failed", "server") and "restarted" in row["error"]
    assert restarted.runs.model("m", "o")["status"].startswith("unloaded")


def test_user_and_server_errors_are_categorised_and_isolated_by_owner(hub):
    async def scenario():
        scheduler = Scheduler(hub, trainers=None, gap_timeout=5)

        async def bad_input() -> Payload:
            raise UserError("weights has the wrong shape")

        async def crash() -> Payload:
            raise RuntimeError("trainer exploded")

        user = scheduler.submit(owner="o", kind="k", job=bad_input, model_id="a", seq_id=1)
        server = scheduler.submit(owner="o", kind="k", job=crash, model_id="a", seq_id=2)
        return await hub.wait(user, "o", 5), await hub.wait(server, "o", 5), await hub.wait(user, "intruder", 0)

    user, server, foreign = run(scenario())
    assert (user["state"], user["category"], user["error"]) == ("failed", "user", "weights has the wrong shape")
    assert (server["state"], server["category"]) == ("failed", "server") and "trainer exploded" in server["error"]
    assert foreign is None


def test_records_use_wal_and_carry_a_schema_version(tmp_path):
    records = Records(tmp_path / "r.sqlite3")
    assert records.file.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert [row["version"] for row in records.file.db["schema_version"].rows] == [SCHEMA_VERSION]
    Records(tmp_path / "r.sqlite3")  # reopening an existing database keeps one version row
    assert records.file.db["schema_version"].count == 1


def test_a_turn_far_ahead_runs_after_the_gap_and_late_skipped_turns_run_once(hub):
    """A client jumping to seq_id 2**62 must not make the lane list every number it skipped (that would hang the
    server); a skipped number arriving late still runs, once."""
    async def scenario():
        scheduler = Scheduler(hub, trainers=None, gap_timeout=0.2)
        log: list[str] = []
        far = scheduler.submit(owner="o", kind="k", job=recorder(log, "far"), model_id="a", seq_id=2**62)
        await hub.wait(far, "o", 3)
        late = scheduler.submit(owner="o", kind="k", job=recorder(log, "5-late"), model_id="a", seq_id=5)
        await hub.wait(late, "o", 3)
        again = scheduler.submit(owner="o", kind="k", job=recorder(log, "5-again"), model_id="a", seq_id=5)
        return log, await hub.wait(again, "o", 3)

    log, again = run(scenario())
    assert log == ["far", "5-late"]
    assert again["state"] == "failed" and "already used" in again["error"]
