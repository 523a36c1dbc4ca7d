"""Log line formats, shared by the server process and the Ray actors it starts (they log through Ray to the server's
stderr): readable text by default, or one JSON object per line with ``--log-format json`` for log collectors.

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

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the record's ``extra`` fields, and any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str | int = logging.INFO, fmt: str | None = None) -> None:
    """Set up the root logger once per process, in ``fmt`` (``text`` or ``json``; default: from the environment)."""
    fmt = fmt or os.environ.get(ENV, "text")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
