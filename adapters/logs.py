"""Log line formats, shared by the server process and the Ray actors it starts (they log through Ray to the server's
stderr): readable text by default, or one JSON object per line with ``--log-format json`` for log collectors.

In JSON mode every line the server prints is a JSON object: uvicorn's and Ray's own loggers and Python warnings go
through the same handler, and Ray forwards actor lines without its ``(SamplerActor pid=…)`` prefix and without
folding repeated lines into ``[repeated 2x across cluster]`` (each entry has its ``pid`` instead).

Lifecycle events carry their facts as ``extra`` fields (``event``, ``model_id``, ``loss``, ``tokens_per_s``…): in text
they are already in the message; in JSON they become keys of their own, so nobody has to parse messages.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ENV = "COMPAT_SERVER_LOG_FORMAT"
"""How the server tells its Ray actors the format: they inherit its environment."""

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName", "color_message"}
"""Record attributes that are not an event's facts (``color_message`` is uvicorn's ANSI copy of the message)."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the record's ``extra`` fields, and any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "pid": record.process,
                 "message": record.getMessage()}
        entry.update({k: v for k, v in record.__dict__.items()
                      if k not in _STANDARD and not k.startswith("_")})  # Ray's record factory adds _ray_timestamp_ns
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str | int = logging.INFO, fmt: str | None = None) -> None:
    """Set up the root logger once per process, in ``fmt`` (``text`` or ``json``; default: from the environment)."""
    fmt = fmt or os.environ.get(ENV, "text")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if fmt == "json":
        logging.captureWarnings(True)  # Python warnings are log records too, not raw lines on stderr
        _ray_logs_as_json()


def _ray_logs_as_json() -> None:
    """Ray prefixes and de-duplicates the lines it forwards from actors, and its own logger has a text handler. The
    two variables are read when Ray is imported (so before it, here) and inherited by the actors."""
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray  # noqa: F401 - imported now so that its logger exists, with its handler, to be redirected

    ray_logger = logging.getLogger("ray")
    ray_logger.handlers.clear()
    ray_logger.propagate = True
