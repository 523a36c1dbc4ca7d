"""``python -m tests.serve serve …``: the server's own entry point (``compat_server.cli.main``), in a process that
also answers a question the tests ask of a running server: which modules has it imported? On SIGUSR1 it writes
their names, one per line, to the file ``$COMPAT_SERVER_TEST_MODULES`` names (``tests/test_server_imports.py``
asks this of the shared servers, after the whole run has driven them). Nothing else differs from ``compat-server``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

MODULES_ENV = "COMPAT_SERVER_TEST_MODULES"


def _write_modules(signum, frame) -> None:
    target = Path(os.environ[MODULES_ENV])
    partial = target.with_suffix(".partial")
    partial.write_text("\n".join(sorted(sys.modules)) + "\n")
    partial.replace(target)  # whole or absent: the test waits for the file, never reads half of it


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _write_modules)
    from compat_server.cli.main import main

    main()
