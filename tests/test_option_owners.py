"""Every option's default is written once, where the option is declared: ``option(...)`` in ``ServerConfig`` or in a
component's options dataclass, which ``ServerConfig`` nests and hands to the component whole. A copy elsewhere drifts:
``VLLMOptions.max_lora_rank`` once defaulted to 64 and ``TrainingService``'s to 512 while ``--max-lora-rank`` said
128. These tests read the source (nothing is run) and fail where a copy comes back:

1. no other dataclass field, and no ``__init__`` parameter, named as an option (its flag's name, ``max_lora_rank``
   for ``--max-lora-rank``, or its field's in a component's options, ``max_resident``) has a default of its own;
2. where the server passes a value of its config on (``CheckpointStore(root, config.min_checkpoint_ttl)``), the
   parameter that takes it has no default of its own.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from compat_server.config import ServerConfig
from shims.option import option_fields, option_flag

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("adapters", "compat_server", "shims")
DECLARING = {"option", "nested"}
"""The calls that declare an option, or a component's options, with their default."""

FIELD_NAMES = {field.name for _, field in option_fields(ServerConfig)}
FLAG_NAMES = {option_flag(field).lstrip("-").replace("-", "_") for _, field in option_fields(ServerConfig)}

FACTS = {"adapters/trainer/interface.py": {"ModelFacts"}, "adapters/samplers/interface.py": {"SamplerFacts"}}
"""What a component reports of itself, read where it runs (``threads``, ``shards``, ``tensor_parallel_size`` as they
are): named as the options that set them, but facts, not options; their defaults stand for "not reported"."""


def _sources() -> list[tuple[str, ast.Module]]:
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text()))
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def _declares(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in DECLARING


def _copies(names: set[str]) -> list[str]:
    """``file: Class.name`` for each defaulted dataclass field or ``__init__`` parameter called one of ``names``."""
    found = []
    for where, tree in _sources():
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            if cls.name in FACTS.get(where, ()):
                continue
            for node in cls.body:
                if (_is_dataclass(cls) and isinstance(node, ast.AnnAssign) and node.value is not None
                        and isinstance(node.target, ast.Name) and node.target.id in names
                        and not _declares(node.value)):
                    found.append(f"{where}: {cls.name}.{node.target.id} = {ast.unparse(node.value)}")
                if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                    arguments = node.args.posonlyargs + node.args.args
                    defaulted = list(zip(arguments[len(arguments) - len(node.args.defaults):], node.args.defaults))
                    defaulted += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
                    found += [f"{where}: {cls.name}({argument.arg}={ast.unparse(default)})"
                              for argument, default in defaulted if argument.arg in names]
    return found


def test_no_dataclass_or_constructor_has_a_default_of_its_own_for_an_option():
    assert _copies(FLAG_NAMES | FIELD_NAMES) == []


def test_the_check_finds_a_copied_default(tmp_path, monkeypatch):
    """What it found before the options were nested: each component's dataclass restated them."""
    check = importlib.import_module(__name__)
    copied = tmp_path / "adapters" / "copied.py"
    copied.parent.mkdir()
    copied.write_text("from dataclasses import dataclass\n\n\n@dataclass(frozen=True)\nclass VLLMOptions:\n"
                      "    max_lora_rank: int = 64\n\n\nclass TrainingService:\n"
                      "    def __init__(self, records, max_lora_rank: int = 512) -> None:\n        pass\n")
    monkeypatch.setattr(check, "ROOT", tmp_path)
    monkeypatch.setattr(check, "PACKAGES", ("adapters",))
    assert check._copies(FLAG_NAMES) == ["adapters/copied.py: VLLMOptions.max_lora_rank = 64",
                                         "adapters/copied.py: TrainingService(max_lora_rank=512)"]


def _mentions_config(node: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "config" or isinstance(n, ast.Attribute) and n.attr == "config"
               for n in ast.walk(node))


def _parameters_fed_from_config(module_name: str, tree: ast.Module) -> list[str]:
    """``Callee(parameter=default)`` for each parameter with a default that a call in the module passes a value of
    the server's config to (callees named in the module itself; calls through attributes are not followed)."""
    module = importlib.import_module(module_name)
    found = []
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        callee = getattr(module, call.func.id, None)
        if not getattr(callee, "__module__", "").startswith(PACKAGES):  # another library's defaults are its own
            continue
        try:
            parameters = list(inspect.signature(callee).parameters.values())
        except (TypeError, ValueError):  # a builtin, an exception class, nothing this module names
            continue
        given = [(p, a) for p, a in zip(parameters, call.args) if p.kind is not p.VAR_POSITIONAL]
        given += [(p, k.value) for k in call.keywords for p in parameters if p.name == k.arg]
        found += [f"{module_name}: {call.func.id}({p.name}={p.default!r})" for p, value in given
                  if p.default is not p.empty and _mentions_config(value)]
    return found


@pytest.mark.parametrize("module_name", ["compat_server.services", "compat_server.app", "compat_server.cli.main",
                                         "compat_server.routes.tinker.training",
                                         "compat_server.routes.tinker.sessions"])
def test_what_the_server_passes_on_from_its_config_has_no_default_where_it_is_taken(module_name):
    path = ROOT / (module_name.replace(".", "/") + ".py")
    assert _parameters_fed_from_config(module_name, ast.parse(path.read_text())) == []
