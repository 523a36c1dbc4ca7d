"""Every file, directory, test and module of this repository that the manual, the benchmark record, the error
messages, docstrings and comments name exists (``tests/doc_references.py`` says what counts as such a name). No
server: a second or so of reading files."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.doc_references import Repository


@pytest.fixture(scope="module")
def repository() -> Repository:
    """The checkout's own names; git lists its files (a copy outside git, such as an unpacked sdist, cannot say
    which files are the repository's)."""
    repository = Repository()
    try:
        repository.files
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs a git checkout to list the repository's files: {exc}")
    return repository


def test_every_repository_path_named_in_the_docs_and_the_code_exists(repository):
    stale = repository.all_stale()
    assert not stale, "names of files or modules that do not exist:\n" + "\n".join(map(str, stale))


def names(repository: Repository, text: str, document: str = "docs/page.md") -> list[str]:
    return [stale.name for stale in repository.stale(document, text)]


def test_a_stale_path_module_or_test_is_reported(repository):
    text = """
    The loss table is in `shims/nonexistent.py` (see also shims/custom_loss_gone/ and .ci/nothing).
    Run `tests/test_options.py::test_that_was_renamed` or `python -m adapters.trainer.vanished`; see
    [the lock](docs/development.md#the-old-lock).
    ``shims.openai_gone_*`` and `tests/test_nothing_*.py`; the layers are in layers_gone.py.
    """
    assert names(repository, text) == [
        "shims/nonexistent.py", "shims/custom_loss_gone/", ".ci/nothing",
        "tests/test_options.py::test_that_was_renamed", "adapters.trainer.vanished", "docs/development.md#the-old-lock",
        "tests/test_nothing_*.py", "shims.openai_gone_*", "layers_gone.py"]


def test_what_exists_or_is_not_ours_is_not_reported(repository):
    text = """
    `shims/custom_loss/graph.py`, adapters/trainer/, `.ci/run`, bench/RESULTS.md, tests/test_shims_*.py,
    `tests/test_options.py::test_the_help_tells_each_options_default[x]`, the tests. Then: a sentence ends in tests.
    `adapters.trainer.shards`, `shims.option.option`, `python -m contract.generate --check`, shims.open*.
    https://github.com/org/project/blob/main/tests/gone.py, ~/.cache/compat-server/tests/gone, $OUT/bench/gone.json,
    tinker_cookbook/recipes/gone.py, torchtitan/models/gone/, DATA_DIR/checkpoints/<run>/sampler_weights/,
    tests/data/<name>/gone, the metric compat_server.futures.finished, the logger compat_server.sampler.
    [vLLM](docs/compatibility.md#compared-with-vllms-openai-server), [the lock](docs/development.md#the-lock).
    """
    assert names(repository, text) == []


def test_bare_file_names_are_checked_in_the_manual_only(repository):
    assert names(repository, "multi-LoRA layers (gone_layers.py), linear.py") == ["gone_layers.py"]
    assert names(repository, "the SDK's tinker_minimal.py", document="tests/x.py") == []


def test_code_is_read_by_its_strings_and_comments_not_its_code(tmp_path: Path):
    (tmp_path / "shims").mkdir()
    (tmp_path / "shims" / "__init__.py").write_text("")
    (tmp_path / "shims" / "ops.py").write_text(
        '"""The allow-list; ``shims.ops`` and shims/ops.py exist."""\n'
        'shims = []\n'
        'shims.append("#")  # the graph is checked in shims/graph_gone.py\n'
        'message = ("a node outside the allow-list "\n'
        '           f"in shims/custom_loss_ops.py: {shims!r}")\n'
        'LOGGER = "shims.log_name"  # a logger, not a module\n')
    (tmp_path / "README.md").write_text("See `shims/ops.py`, `shims.gone` and the logger `shims.log_name`.\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    stale = Repository(tmp_path).all_stale()
    assert [(s.document, s.line, s.name) for s in stale] == [
        ("README.md", 1, "shims.gone"),
        ("shims/ops.py", 3, "shims/graph_gone.py"),
        ("shims/ops.py", 5, "shims/custom_loss_ops.py")]
