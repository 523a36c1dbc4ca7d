"""The options of ``compat-server serve``: one flag and one environment variable for each option of ``ServerConfig``
and of the component options it nests, their defaults in the help, the environment overridden by the command line,
bad values refused by name, and each component's options made its own dataclass."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from adapters.models.tiny import TINY_MODEL_NAME
from adapters.samplers.options import SamplerOptions
from adapters.samplers.vllm.options import VLLMOptions
from adapters.trainer.options import TrainerOptions
from compat_server.cli.options import config_from_args, serve_parser
from compat_server.config import ServerConfig
from shims.option import option_default, option_fields, option_value

FIELDS = dict(option_fields(ServerConfig))
"""Every option, by its path (``max_body_mb``, ``trainer.cpus``, ``sampler.vllm.max_loras``)."""


def parser() -> argparse.ArgumentParser:
    return serve_parser(argparse.ArgumentParser(prog="compat-server serve"))


def config(*argv: str) -> ServerConfig:
    return config_from_args(parser().parse_args(list(argv)))


def options() -> list[argparse.Action]:
    return [action for action in parser()._actions if action.dest != "help"]


def env_name(action: argparse.Action) -> str:
    (name,) = re.findall(r"\[env (COMPAT_SERVER_\w+)\]$", action.help or "")
    return name


def default(name: str) -> Any:
    return option_default(FIELDS[name])


def values(made: ServerConfig) -> dict[str, Any]:
    return {path: option_value(made, path) for path in FIELDS}


def test_every_config_field_has_exactly_one_flag_and_one_environment_variable():
    actions = options()
    assert sorted(action.dest for action in actions) == sorted(FIELDS)  # one each, and no option beyond the fields
    assert all(len(action.option_strings) == 1 for action in actions)
    assert len({env_name(action) for action in actions}) == len(FIELDS)
    assert [action.dest for action in actions] == list(FIELDS)  # in the config's order, which groups them by topic


def test_the_help_tells_each_options_default():
    formatter = argparse.HelpFormatter("compat-server serve")
    for action in options():
        text = formatter._expand_help(action)
        value = default(action.dest)
        if value is None:
            assert "default" in text.lower(), f"{action.option_strings[0]} does not say what unset means: {text}"
        elif not isinstance(value, bool | list | dict):
            assert f"default: {value}" in text, f"{action.option_strings[0]}'s help misses its default: {text}"


def test_unset_options_make_the_default_config(monkeypatch):
    for action in options():
        monkeypatch.delenv(env_name(action), raising=False)
    made = config()
    made.validate()
    assert made == ServerConfig(data_dir=ServerConfig().data_dir.resolve())
    assert made.base_models == [TINY_MODEL_NAME] and made.custom_loss_server_side is True


def other_value(action: argparse.Action, tmp_path: Path, turn: int) -> tuple[list[str], Any]:
    """A value of the option that is not its default (another one for each ``turn``): its items as given (one for a
    repeatable option on the command line each time it is given), and the value the config gets."""
    value = default(action.dest)
    if action.choices:
        chosen = [*(choice for choice in action.choices if choice != value), value][turn]
        return [str(chosen)], chosen
    if action.nargs == 0:
        return ["1"], not value
    if isinstance(action, argparse._AppendAction) and action.type is None:
        return [f"m{turn}", f"n{turn}"], [f"m{turn}", f"n{turn}"]
    if isinstance(action, argparse._AppendAction):
        return [f"node_{turn}=1", "other=2.5"], {f"node_{turn}": 1.0, "other": 2.5}
    if action.type is Path:
        return [str(tmp_path / f"dir{turn}")], tmp_path / f"dir{turn}"
    if action.type in (int, float):
        return [str(500 + turn)], action.type(500 + turn)
    return [f"text-{turn}"], f"text-{turn}"


def test_the_environment_sets_every_option_and_the_command_line_wins(monkeypatch, tmp_path):
    argv: list[str] = []
    from_env, from_argv = {}, {}
    for action in options():
        items, from_env[action.dest] = other_value(action, tmp_path, 0)
        monkeypatch.setenv(env_name(action), ",".join(items))
        items, from_argv[action.dest] = other_value(action, tmp_path, 1)
        if action.nargs == 0:  # a flag: the environment turned it on already, and it stays on
            from_argv[action.dest] = from_env[action.dest]
        for item in items:
            argv += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], item]
    assert values(config()) == from_env
    assert values(config(*argv)) == from_argv


@pytest.mark.parametrize("env", [{}, {"COMPAT_SERVER_BASE_MODEL": "a,b", "COMPAT_SERVER_TRAINER_RESOURCE": "x=1"}])
def test_a_repeated_option_on_the_command_line_replaces_the_environments(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    made = config("--base-model", "c", "--base-model", "d", "--trainer-resource", "gpu_node=0.5")
    assert made.base_models == ["c", "d"] and made.trainer.resources == {"gpu_node": 0.5}


def test_a_flag_in_the_environment_reads_as_a_boolean(monkeypatch):
    monkeypatch.setenv("COMPAT_SERVER_ACCESS_LOG", "yes")
    monkeypatch.setenv("COMPAT_SERVER_CLIENT_SIDE_CUSTOM_LOSSES", "true")
    made = config()
    assert made.access_log is True and made.custom_loss_server_side is False
    monkeypatch.setenv("COMPAT_SERVER_ACCESS_LOG", "0")
    monkeypatch.setenv("COMPAT_SERVER_CLIENT_SIDE_CUSTOM_LOSSES", "off")
    made = config()
    assert made.access_log is False and made.custom_loss_server_side is True
    assert config("--client-side-custom-losses").custom_loss_server_side is False


def test_paths_are_expanded_and_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    made = config("--data-dir", "~/data", "--storage-dir", "shared")
    assert made.data_dir == tmp_path / "home" / "data" and made.storage_dir == tmp_path / "shared"
    assert config().storage_dir is None


BAD = {  # a value each checked option refuses
    "--samplers": "0", "--max-batch-tokens": "0", "--max-batch-datums": "0", "--max-adapters": "0",
    "--max-adapters-per-key": "0", "--max-pending-per-key": "0", "--sampler-batch": "0", "--max-resident-adapters": "0",
    "--max-num-samples": "0",
    "--max-logprobs-k": "-1", "--max-logprobs": "-1", "--max-stop-strings": "-1", "--max-temperature": "-0.5",
    "--custom-loss-max-nodes": "0", "--custom-loss-max-nesting": "0", "--custom-loss-max-constants": "0",
    "--custom-loss-max-elements": "0", "--max-custom-losses-per-key": "0", "--drift-probe-every": "-1",
    "--ephemeral-keep": "0", "--stability-ttl": "0", "--min-checkpoint-ttl": "0", "--expiry-sweep-seconds": "0",
    "--session-timeout": "0", "--download-url-ttl": "0", "--token-ttl": "119", "--max-lora-rank": "100",
    "--sampler-dtype": "fp8", "--max-model-len": "1", "--vllm-max-loras": "0", "--vllm-kv-cache-gb": "0",
    "--vllm-gpu-memory-utilization": "1.5", "--trainer-cpus": "-1", "--sampler-cpus": "-1",
    "--sampler-tensor-parallel-size": "0",
    "--poll-hold-seconds": "-1", "--seq-gap-timeout": "0", "--max-body-mb": "0", "--auth": "none",
    "--sampler-backend": "tgi", "--log-level": "LOUD", "--log-format": "xml",
}


@pytest.mark.parametrize("flag", BAD)
def test_a_bad_value_is_refused_naming_its_flag_alone(flag, monkeypatch):
    monkeypatch.setenv("COMPAT_SERVER_" + flag[2:].upper().replace("-", "_"), BAD[flag])  # argparse checks no default
    with pytest.raises(ValueError, match="^[^;]*$") as refused:
        config().validate()
    assert str(refused.value).startswith(f"{flag} must be ")


def test_every_bad_value_is_named_at_once(monkeypatch):
    for flag, value in BAD.items():
        monkeypatch.setenv("COMPAT_SERVER_" + flag[2:].upper().replace("-", "_"), value)
    with pytest.raises(ValueError) as refused:
        config().validate()
    assert sorted(problem.split(" must be ")[0] for problem in str(refused.value).split("; ")) == sorted(BAD)


def test_open_auth_is_refused_on_a_reachable_address_unless_allowed():
    with pytest.raises(ValueError, match="--auth open on 0.0.0.0 would let anyone"):
        config("--host", "0.0.0.0", "--auth", "open").validate()
    config("--host", "0.0.0.0", "--auth", "open", "--allow-open-auth").validate()
    config("--host", "::1", "--auth", "open").validate()
    assert config("--host", "0.0.0.0").auth_mode == "keys"


def test_each_component_gets_its_options_as_its_own_dataclass():
    made = config("--trainer-cpus", "2", "--samplers", "3", "--vllm-max-loras", "2", "--max-session-tags", "5")
    assert made.trainer == TrainerOptions(cpus=2.0) and made.sampler == SamplerOptions(count=3, vllm=VLLMOptions(
        max_loras=2))
    assert made.sessions.tags == 5 and made.sessions.field_chars == ServerConfig().sessions.field_chars


def test_the_max_lora_rank_the_samplers_are_started_for_is_the_cli_s():
    """It once defaulted to 64 in the vLLM options and to 512 in the training service, against the CLI's 128."""
    assert config().sampler.vllm.max_lora_rank == VLLMOptions().max_lora_rank == 128
