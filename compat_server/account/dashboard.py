"""What the dashboard (``GET /``) shows one API key: its sessions, training runs with their loss curves, checkpoints,
its own sampling counts, and its recent errors. Assembled from the records and the pools; every part is scoped to
the viewer's key. Server-wide sampling counts and the sampler replicas' load are shown to operator keys only."""

from __future__ import annotations

from compat_server.records import Records
from compat_server.sampling.service import SamplingService

RECENT = 20
STEPS_PER_RUN = 500


def loss_of(metrics: dict[str, float]) -> float | None:
    """The step's loss: the first ``loss:<reduction>`` metric (``loss:sum`` for the built-in losses)."""
    return next((value for key, value in metrics.items() if key.startswith("loss:")), None)


async def dashboard(records: Records, sampling: SamplingService, owner: str) -> dict:
    runs, _ = records.runs.models_page(owner, limit=RECENT, offset=0)
    checkpoints, total_checkpoints = records.checkpoints.user_checkpoints(owner, limit=RECENT, offset=0)
    admin = records.tenants.is_admin(owner)
    pool = await sampling.metrics(None if admin else owner)
    return {
        "sessions": [{"id": s["id"], "created": s["created"], "last_heartbeat": s["last_heartbeat"],
                      "finished": s["finished"], "finish_reason": s["finish_reason"]}
                     for s in records.sessions.recent_sessions(owner, RECENT)],
        "training_runs": [{
            "id": run["id"], "base_model": run["base_model"], "lora_rank": run["lora_rank"], "status": run["status"],
            "created": run["created"], "rolled_back": run["rolled_back"],
            "steps": [{"seq_id": step["seq_id"], "kind": step["kind"], "loss_fn": step["loss_fn"],
                       "loss": loss_of(step["metrics"]), "tokens": step["num_tokens"],
                       "tokens_per_s": step["tokens_per_s"], "time": step["created"]}
                      for step in records.runs.steps(run["id"], "forward_backward", STEPS_PER_RUN)],
        } for run in runs],
        "checkpoints": {"total": total_checkpoints, "latest": [
            {"tinker_path": c["tinker_path"], "kind": c["kind"], "size_bytes": c["size_bytes"],
             "created": c["created"], "expires_at": c["expires_at"], "public": bool(c["public"])}
            for c in checkpoints]},
        "samplers": {name: {"backend": stats["backend"], "requests": stats["requests"],
                            "sampled_tokens": stats["sampled_tokens"],
                            **({"replicas": [{"in_flight": r["in_flight"], "resident_adapters": r["resident_adapters"]}
                                             for r in stats["replicas"]]} if admin else {})}
                     for name, stats in pool.items()},
        "recent_errors": records.futures.recent_failures(owner, RECENT),
    }
