"""The options of ``compat-server serve``, made from ``ServerConfig``'s fields and the component options it nests
(their help, flags and checks are declared there, with ``shims.option.option``): a group of flags per component,
their environment-variable defaults, and the ``ServerConfig`` they make."""

from __future__ import annotations

import argparse
import os
import types
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from compat_server.config import ServerConfig
from shims.option import NESTED, OPTION, option_default, option_flag


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT, e.g. trainer_node=1; got {text!r}") from None


@dataclass(frozen=True)
class _Option:
    path: str
    """Where the value goes: ``max_body_mb``, ``trainer.cpus``; also its ``argparse`` dest."""
    field: Field[Any]
    value_type: Any
    """The field's type, unset (None) taken away: ``int`` for ``int | None``."""
    group: str | None
    """The title of the component it belongs to (None: the server's own)."""


def _options(cls: type, prefix: str = "", group: str | None = None) -> list[_Option]:
    """Every option of ``cls`` and of the components it nests, in declaration order."""
    hints = get_type_hints(cls)
    found = []
    for each in fields(cls):
        hint = hints[each.name]
        if NESTED in each.metadata:
            found += _options(hint, f"{prefix}{each.name}.", each.metadata[NESTED])
            continue
        if isinstance(hint, types.UnionType):
            (hint,) = (arg for arg in get_args(hint) if arg is not type(None))
        found.append(_Option(prefix + each.name, each, hint, group))
    return found


OPTIONS = _options(ServerConfig)


def _argument(option: _Option) -> dict[str, Any]:
    """``add_argument``'s keywords for an option: a bool is a flag (the negation of a field that defaults to True), a
    list or dict a repeatable option (a dict's items NAME=AMOUNT), anything else a value of the field's type."""
    spec = option.field.metadata[OPTION]
    default = option_default(option.field)
    metavar = spec.metavar or (None if spec.choices else  # argparse shows the choices; else the flag, not the path
                               option_flag(option.field).lstrip("-").upper().replace("-", "_"))
    keywords: dict[str, Any] = {"dest": option.path, "help": spec.help}
    if option.value_type is bool:
        return keywords | {"action": "store_false" if default else "store_true"}
    if get_origin(option.value_type) in (list, dict):  # unset: None, and the field's default
        repeated = {"type": _resource, "metavar": "NAME=AMOUNT"} if get_origin(option.value_type) is dict else {}
        return keywords | {"action": "append", "metavar": spec.metavar} | repeated
    keywords |= {"type": option.value_type, "default": default, "metavar": metavar}
    return keywords | ({"choices": list(spec.choices)} if spec.choices is not None else {})


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    groups: dict[str | None, Any] = {None: parser}
    for option in OPTIONS:
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        groups[option.group].add_argument(option_flag(option.field), **_argument(option))
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
    default (``--base-model``'s is the built-in model), NAME=AMOUNT items made a dict, each component's options made
    its own dataclass."""
    values: dict[str, Any] = {}
    for option in OPTIONS:
        value = getattr(args, option.path)
        container = get_origin(option.value_type)
        if container in (list, dict):
            if not value:
                continue
            value = container(value)
        elif isinstance(value, Path):
            value = value.expanduser().resolve()
        values[option.path] = value
    return _made(ServerConfig, values)


def _made(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """``cls`` of the ``values`` given for its options and its components' (by path), the others left at their
    defaults."""
    hints = get_type_hints(cls)
    kwargs = {}
    for each in fields(cls):
        if NESTED in each.metadata:
            kwargs[each.name] = _made(hints[each.name], values, f"{prefix}{each.name}.")
        elif prefix + each.name in values:
            kwargs[each.name] = values[prefix + each.name]
    return cls(**kwargs)
