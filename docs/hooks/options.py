"""MkDocs hook: the options page's table, made at build time from the one declaration of the options.

Every option of ``compat-server serve`` is a field declared with ``option(...)``, of
``compat_server.config.ServerConfig`` or of a component's options it nests (``nested(...)``: the trainer's, the
samplers'…); ``compat_server.cli.options`` makes its flag, its environment variable and its ``--help`` from it. The
tables are made by those same functions, from the parser ``serve`` uses, so the page cannot drift from what the server
accepts: a new option, a changed default or a reworded help shows up at the next build. ``docs/options.md`` holds the
placeholder it replaces."""

from __future__ import annotations

import argparse
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import Field
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

# The checkout that holds this mkdocs.yml, ahead of any installed copy: the page documents the code beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compat_server.cli.options import ENV_PREFIX, OPTIONS, environment_variable, serve_parser  # noqa: E402
from shims.option import option_default, option_flag  # noqa: E402

# What the table replaces: the markers and, between them, what a reader of the unbuilt file sees instead.
PLACEHOLDER = re.compile(r"<!-- options-table -->.*?<!-- /options-table -->", re.S)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri == "options.md" and not PLACEHOLDER.search(markdown):
        raise PluginError("docs/options.md lost its <!-- options-table --> markers: the options table has no place")
    return PLACEHOLDER.sub(lambda _: options_table(), markdown)


def options_table() -> str:
    """One table per group of options, in the order ``--help`` shows them (the server's own first, then each
    component's): the flag as ``--help`` writes it, its environment variable, its default and its help,
    ``%(default)s`` expanded by argparse."""
    with _environment_without_options():
        parser = serve_parser(argparse.ArgumentParser(prog="compat-server serve"))
    actions = {action.dest: action for action in parser._actions}
    formatter = parser._get_formatter()
    tables: dict[str | None, list[str]] = {}
    for option in OPTIONS:
        action = actions[option.path]
        variable = environment_variable(option_flag(option.field))
        text = formatter._expand_help(action).removesuffix(f" [env {variable}]")
        invocation = formatter._format_action_invocation(action)
        rows = tables.setdefault(option.group, ["| Option | Environment variable | Default | What it sets |",
                                                "|---|---|---|---|"])
        rows.append(f"| `{invocation}` | `{variable}` | {_default(option.field)} | {_escape(_home(text))} |")
    return "\n\n".join(f"### {group or 'The server'}\n\n" + "\n".join(rows) for group, rows in tables.items())


@contextmanager
def _environment_without_options():
    """The parser takes its defaults from ``COMPAT_SERVER_*`` variables; the page shows the declared ones."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(ENV_PREFIX)}
    try:
        yield
    finally:
        os.environ.update(saved)


def _default(option_field: Field[Any]) -> str:
    value = option_default(option_field)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "off"  # a flag is given or not; a field that defaults to True has the negation as its flag
    if isinstance(value, list | dict):
        items = [f"{k}={v:g}" for k, v in value.items()] if isinstance(value, dict) else list(map(str, value))
        return ", ".join(f"`{item}`" for item in items) or "none"
    return f"`{_home(str(value))}`"


def _home(text: str) -> str:
    """A default under the home directory of whoever builds the site (the data directory) written as ``~``."""
    home = str(Path.home())
    return text if home == "/" else text.replace(home + "/", "~/")


def _escape(text: str) -> str:
    """Help text as Markdown shows it literally inside a table cell."""
    for character in "\\`*_[]|":
        text = text.replace(character, "\\" + character)
    return text.replace("<", "&lt;")
