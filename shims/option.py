"""What a server option is: a field declared with ``option(...)`` carries its default, its ``--help`` text, its flag
(when not the field's name) and the check its value must pass. Each component declares its own options so, in a
dataclass it is given whole (``adapters.trainer.options.TrainerOptions``, ...); ``ServerConfig`` nests them
(``nested``), and the CLI and ``ServerConfig.validate`` walk them (``option_fields``). Pure declarations, so every
layer may use them: the server's CLI reads them without importing any component's code."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar, overload

T = TypeVar("T")

OPTION = "option"
"""The key of a field's metadata that holds its ``Option``."""


@dataclass(frozen=True)
class Check:
    """A condition on an option's value, and what the error says when it fails (``--samplers must be at least 1``)."""

    ok: Callable[[Any], bool]
    must: str


def at_least(least: float, unit: str = "") -> Check:
    return Check(lambda value: value >= least,
                 "must be 0 or more" if least == 0 else " ".join(filter(None, [f"must be at least {least}", unit])))


ABOVE_ZERO = Check(lambda value: value > 0, "must be > 0")


@dataclass(frozen=True)
class Option:
    help: str
    flag: str | None = None
    """The command-line flag; default: the field's name, ``--like-this``. A ``True`` flag's is its negation."""
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    check: Check | None = None

    def refuses(self, value: Any) -> str | None:
        """Why ``value`` is refused (``"must be …"``), or None; an unset (None) value is always accepted."""
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}"
        if self.check is not None and not self.check.ok(value):
            return self.check.must
        return None


@overload
def option(default: T, help: str = ..., *, flag: str | None = ..., metavar: str | None = ...,
           choices: tuple[Any, ...] | None = ..., check: Check | None = ...) -> T: ...
@overload
def option(*, factory: Callable[[], T], help: str, flag: str | None = ..., metavar: str | None = ...,
           choices: tuple[Any, ...] | None = ..., check: Check | None = ...) -> T: ...
def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           flag: str | None = None, metavar: str | None = None, choices: tuple[Any, ...] | None = None,
           check: Check | None = None) -> Any:
    """A field that is a server option: its default (a list or dict one is copied for each config; ``factory`` makes
    it when each config is made), its help (``%(default)s`` shows the default) and the rest of its ``Option``."""
    metadata = {OPTION: Option(help, flag, metavar, choices, check)}
    if factory is None and isinstance(default, list | dict):
        factory = lambda: copy.copy(default)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def option_flag(option_field: Field[Any]) -> str:
    """``--max-body-mb`` for the field ``max_body_mb``, unless its ``Option`` names another flag."""
    return option_field.metadata[OPTION].flag or "--" + option_field.name.replace("_", "-")


NESTED = "nested"
"""The key of a field's metadata that marks it as a component's options (their dataclass), and holds its title."""


def nested(options: Callable[[], T], title: str) -> T:
    """A field holding a component's options: a dataclass of ``option(...)`` fields (and maybe more nested ones), made
    with its own defaults. The CLI shows its options together under ``title``."""
    return field(default_factory=options, metadata={NESTED: title})


def option_fields(cls: type, prefix: str = "") -> list[tuple[str, Field[Any]]]:
    """Every option of ``cls`` and of the components' options it nests, in declaration order (a nested component's
    where it is declared), each with its path: ``max_body_mb``, ``trainer.cpus``, ``sampler.vllm.max_loras``."""
    found: list[tuple[str, Field[Any]]] = []
    for each in fields(cls):
        if OPTION in each.metadata:
            found.append((prefix + each.name, each))
        elif NESTED in each.metadata:
            found += option_fields(each.default_factory, f"{prefix}{each.name}.")  # type: ignore[arg-type]
    return found


def option_value(config: Any, path: str) -> Any:
    """The value at ``path`` (as ``option_fields`` names it) of ``config``."""
    for name in path.split("."):
        config = getattr(config, name)
    return config


def option_default(option_field: Field[Any]) -> Any:
    """The option's default, made afresh where a factory makes it."""
    return option_field.default if option_field.default_factory is MISSING else option_field.default_factory()
