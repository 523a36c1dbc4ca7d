"""The manual's options page (``docs/hooks/options.py``): one row per option (``ServerConfig``'s own and the
components' it nests), with the flag and the environment variable ``compat-server serve`` takes, the declared default
and the help as ``--help`` shows it. No MkDocs build: the hook's tables alone, in well under a second."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from compat_server.cli.options import serve_parser
from compat_server.config import ServerConfig, default_data_dir
from shims.option import option_fields

pytest.importorskip("mkdocs", reason="the manual's hook runs inside MkDocs (the docs extra)")

HOOK = Path(__file__).resolve().parent.parent / "docs" / "hooks" / "options.py"


def hook():
    spec = importlib.util.spec_from_file_location("options_page_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(tables: str) -> list[list[str]]:
    """Every option's row, in order, across the page's tables (each a heading, a header and a separator line)."""
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in tables.splitlines()
            if line.startswith("| `")]


def test_one_row_per_option_with_the_flag_and_variable_serve_takes(monkeypatch):
    monkeypatch.setenv("COMPAT_SERVER_PORT", "9")  # the page shows the declared default, not the builder's
    table = rows(hook().options_table())
    parser = serve_parser(argparse.ArgumentParser())
    helps = {action.option_strings[0]: action.help for action in parser._actions if action.dest != "help"}
    assert len(table) == len(option_fields(ServerConfig)) == len(helps)
    shown = {invocation.strip("`").split()[0]: variable.strip("`") for invocation, variable, _, _ in table}
    assert shown.keys() == helps.keys()
    for flag, variable in shown.items():
        assert helps[flag].endswith(f"[env {variable}]")
    port = next(row for row in table if row[0].startswith("`--port"))
    assert port[2] == "`8000`" and port[3] == "TCP port to listen on (default: 8000)"


def test_help_defaults_are_expanded_as_argparse_does_and_the_home_is_written_as_tilde():
    table = hook().options_table()
    assert "%(default)" not in table and str(Path.home()) + "/" not in table
    shown = str(default_data_dir()).replace(str(Path.home()) + "/", "~/")  # ~/.local/share/compat-server on Linux
    data_dir = next(row for row in rows(table) if row[0].startswith("`--data-dir"))
    assert data_dir[2] == f"`{shown}`" and data_dir[3].endswith(f"(default: {shown})")
