"""The options of ``compat-server serve``, made from ``ServerConfig``'s fields (their help, flags and checks are
declared there, with ``compat_server.option.option``): their environment-variable defaults, and the ``ServerConfig``
they make."""

from __future__ import annotations

import argparse
import os
import types
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from compat_server.config import ServerConfig
from compat_server.option import OPTION, option_flag


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT, e.g. trainer_node=1; got {text!r}") from None


_TYPES = get_type_hints(ServerConfig)


def _value_type(option_field: Field[Any]) -> Any:
    """The field's type, unset (None) taken away: ``int`` for ``int | None``."""
    hint = _TYPES[option_field.name]
    if isinstance(hint, types.UnionType):
        (hint,) = (arg for arg in get_args(hint) if arg is not type(None))
    return hint


def _argument(option_field: Field[Any]) -> dict[str, Any]:
    """``add_argument``'s keywords for a field: a bool is a flag (the negation of a field that defaults to True), a
    list or dict a repeatable option (a dict's items NAME=AMOUNT), anything else a value of the field's type."""
    spec = option_field.metadata[OPTION]
    value_type = _value_type(option_field)
    default = option_field.default if option_field.default_factory is MISSING else option_field.default_factory()
    keywords: dict[str, Any] = {"dest": option_field.name, "help": spec.help}
    if value_type is bool:
        return keywords | {"action": "store_false" if default else "store_true"}
    if get_origin(value_type) in (list, dict):  # unset: None, and the field's default
        repeated = {"type": _resource, "metavar": "NAME=AMOUNT"} if get_origin(value_type) is dict else {}
        return keywords | {"action": "append", "metavar": spec.metavar} | repeated
    keywords |= {"type": value_type, "default": default, "metavar": spec.metavar}
    return keywords | ({"choices": list(spec.choices)} if spec.choices is not None else {})


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for option_field in fields(ServerConfig):
        parser.add_argument(option_flag(option_field), **_argument(option_field))
    return defaults_from_environment(parser)


ENV_PREFIX = "COMPAT_SERVER_"


def environment_variable(flag: str) -> str:
    """The environment variable that sets an option: ``COMPAT_SERVER_MAX_BODY_MB`` for ``--max-body-mb``. One
    function, so that the manual's options page (``docs/hooks/options.py``) names the variable the server reads."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class _AppendReplacingDefault(argparse._AppendAction):
    """A repeatable option whose default came from the environment: given on the command line, it replaces that
    default instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)


def defaults_from_environment(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every option can also be set by an environment variable, ``--max-body-mb`` by ``COMPAT_SERVER_MAX_BODY_MB``
    (for containers). A flag takes 1/true/yes/on; a repeatable option takes a comma-separated list. The command
    line wins over the environment."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = environment_variable(action.option_strings[-1])
        action.help = f"{action.help} [env {name}]"
        value = os.environ.get(name)
        if value is None:
            continue
        if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):  # a flag
            given = value.strip().lower() in ("1", "true", "yes", "on")
            action.default = action.const if given else not action.const
        elif isinstance(action, argparse._AppendAction):
            convert = action.type or str
            action.default = [convert(item.strip()) for item in value.split(",") if item.strip()]
            action.__class__ = _AppendReplacingDefault
        else:
            action.default = value  # argparse converts a string default with the option's type
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The config of parsed ``serve`` options: paths made absolute, a repeatable option not given left at the field's
    default (``--base-model``'s is the built-in model), NAME=AMOUNT items made a dict."""
    values: dict[str, Any] = {}
    for option_field in fields(ServerConfig):
        value = getattr(args, option_field.name)
        container = get_origin(_value_type(option_field))
        if container in (list, dict):
            if not value:
                continue
            value = container(value)
        elif isinstance(value, Path):
            value = value.expanduser().resolve()
        values[option_field.name] = value
    return ServerConfig(**values)
