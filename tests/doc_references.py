"""Names of this repository's files and modules in the manual and in the code's strings and comments, and which of
them do not exist.

A restructuring moves files; the manual, error messages and docstrings that name them stay behind and send a reader
(or a user reading an error) to a file that is gone. ``tests/test_docs_references.py`` fails on each such name.

What counts as a name of this repository:

- a path rooted at one of its top-level directories (``shims/custom_loss/graph.py``, ``adapters/trainer/``,
  ``.ci/run``); a glob (``tests/test_shims_*.py``) must match something; a test id
  (``tests/test_options.py::test_the_help_tells_each_options_default``) must name a function or class of the file,
  and a link into a page (``docs/deployment.md#base-models``) a heading of the page;
- a dotted module name rooted at one of its top-level packages (``adapters.trainer.shards``, ``python -m
  contract.generate``): each part up to a module must be a package directory or a module file (nothing is
  imported); what follows the module are its attributes, not checked;
- in the manual (Markdown), a bare file name ``name.py``: some file of the repository must have that name.

The roots come from git's listing (tracked and untracked files, not ignored ones), so the virtualenvs, caches and
data directories a run creates are not roots. A name counts only where it starts a token, so a path inside another
project (``tinker_cookbook/weights/``, ``~/.cache/huggingface/hub``, a URL, ``$OUT/…``) is never read as ours. A
string literal of the code that is exactly one dotted name (a logger's name, a metric, a span attribute such as
``compat_server.futures.finished``) names something in another namespace than the modules, and so does the same name
in the manual."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import cached_property
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parent.parent

# Where names are looked for: the manual, text files, and the code's strings and comments (its messages, docstrings).
MARKDOWN = ("README.md", "docs/**/*.md", "bench/RESULTS.md")
TEXT = ("mkdocs.yml", "Dockerfile", ".dockerignore", ".ci/run", ".ci/lock", ".ci/container",
        "tests/cookbook-requirements.in")
CODE = ("compat_server/**/*.py", "shims/**/*.py", "adapters/**/*.py", "contract/**/*.py", "tests/**/*.py",
        "bench/**/*.py", "docs/**/*.py", ".ci/*.py")
# The checker and its test: their strings are the patterns, the examples and the planted stale names.
NOT_READ = {"tests/doc_references.py", "tests/test_docs_references.py"}

# The few names that look like names of this repository and are not, each with why: (a glob of where, the name).
ALLOWED = {
    # A dated measurement (bench/RESULTS.md is a record): the LoRA layers it measured lived in this file then; commit
    # 0620220 split it into adapters/lora/linear.py and its neighbours.
    ("bench/RESULTS.md", "adapters/lora/layers.py"),
    # The reader's own script, in the commands that point it at the server.
    ("*.md", "your_tinker_script.py"),
    # A file that test writes into a temporary copy of the package, to show the check finds a copied default.
    ("tests/test_option_owners.py", "adapters/copied.py"),
}

_START = r"(?<![\w.~$/\\@:*-])"  # a name starts a token: not inside a URL, a home or variable path, or a longer name
_PLACEHOLDER = "<{["  # tests/data/<name>/, checkpoints/{run}: checked up to the directory before it
_EXTENSIONS = {"py", "md", "txt", "json", "toml", "yaml", "yml", "in", "sh", "html"}  # bench.py is a file, not a module

# A Python string literal or comment, whichever starts first: a "#" inside a string is the string's, a quote inside a
# comment the comment's. One regular expression over a file, because tokenize (or ast) over the repository takes
# seconds on Python 3.11, and the test must stay fast.
_STRING_OR_COMMENT = re.compile(
    r"#[^\n]*"
    r"|[rRbBuUfF]{0,2}(?:'''(?:\\.|[^\\])*?'''" + r'|"""(?:\\.|[^\\])*?"""'
    r"|'(?:\\.|[^'\\\n])*'" + r'|"(?:\\.|[^"\\\n])*")')
_PREFIX_AND_QUOTES = re.compile(r"""^[rRbBuUfF]*('''|\"\"\"|'|")(.*)\1$""", re.S)


@dataclass(frozen=True)
class Stale:
    document: str
    line: int
    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.document}:{self.line}: {self.name} ({self.why})"


class Repository:
    def __init__(self, root: Path = REPO) -> None:
        self.root = root

    @cached_property
    def files(self) -> list[str]:
        """Every file git lists, tracked or not, and not ignored."""
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=self.root, capture_output=True, check=True).stdout
        return [name for name in listed.decode().split("\0") if name]

    @cached_property
    def tops(self) -> set[str]:
        """The top-level directories: the roots of the paths checked."""
        return {name.split("/", 1)[0] for name in self.files if "/" in name}

    @cached_property
    def packages(self) -> set[str]:
        """The top-level packages: the roots of the module names checked."""
        return {top for top in self.tops if (self.root / top / "__init__.py").is_file()}

    @cached_property
    def file_names(self) -> set[str]:
        return {PurePosixPath(name).name for name in self.files}

    @cached_property
    def path_pattern(self) -> re.Pattern[str]:
        return re.compile(_START + rf"(?:{_either(self.tops)})/[\w./*?-]*")

    @cached_property
    def module_pattern(self) -> re.Pattern[str]:
        return re.compile(_START + rf"(?:{_either(self.packages)})(?:\.\w+)+\*?(?![\w/-])")

    @cached_property
    def python_files(self) -> list[PythonFile]:
        return [PythonFile.read(self.root, path) for pattern in CODE for path in sorted(self.root.glob(pattern))
                if path.relative_to(self.root).as_posix() not in NOT_READ]

    @cached_property
    def identifiers(self) -> set[str]:
        """Dotted names the code uses as whole string literals: loggers, metrics, span attributes."""
        return {value for file in self.python_files for value in file.strings if self.module_pattern.fullmatch(value)}

    def documents(self) -> Iterator[tuple[str, str]]:
        """Each text to check, (where it comes from, the text): the manual, text files, the code's prose."""
        for pattern in (*MARKDOWN, *TEXT):
            for path in sorted(self.root.glob(pattern)):
                yield path.relative_to(self.root).as_posix(), path.read_text()
        for file in self.python_files:
            yield file.name, file.prose()

    def all_stale(self) -> list[Stale]:
        return [stale for document, text in self.documents() for stale in self.stale(document, text)]

    def stale(self, document: str, text: str) -> Iterator[Stale]:
        """Every name of this repository in ``text`` that does not exist. ``document`` is where the text comes from,
        for the report and the allow-list; a Markdown document's bare file names are checked too."""
        markdown = document.endswith(".md")
        for line_number, line in enumerate(text.splitlines(), 1):
            for name, why in self._problems(line, markdown):
                if not any(fnmatch(document, where) and name == allowed for where, allowed in ALLOWED):
                    yield Stale(document, line_number, name, why)

    def _problems(self, line: str, markdown: bool) -> Iterator[tuple[str, str]]:
        for match in self.path_pattern.finditer(line):
            yield from self._path_problems(match.group(), line[match.end():])
        for match in self.module_pattern.finditer(line):
            name = match.group()
            if name.rsplit(".", 1)[1] not in _EXTENSIONS and name not in self.identifiers:
                if why := self.module_problem(name):
                    yield name, why
        if markdown:
            for match in re.finditer(_START + r"\w+\.py\b(?!/)", line):
                if match.group() not in self.file_names:
                    yield match.group(), "no file of this name in the repository"

    def _path_problems(self, name: str, after: str) -> Iterator[tuple[str, str]]:
        if after[:1] and after[0] in _PLACEHOLDER:
            name = name[:name.rfind("/") + 1]
        name = name.rstrip(".-")
        if "*" in name or "?" in name:
            if not any(self.root.glob(name.rstrip("/"))):
                yield name, "the pattern matches nothing"
        elif not (self.root / name).exists():
            yield name, "no such file or directory"
        elif test := re.match(r"::(\w+)", after):
            if not re.search(rf"^\s*(?:async )?(?:def|class) {test[1]}\b", (self.root / name).read_text(), re.M):
                yield f"{name}::{test[1]}", f"{name} has no {test[1]}"
        elif name.endswith(".md") and (anchor := re.match(r"#([\w-]+)", after)):
            if anchor[1] not in _headings(self.root / name):
                yield f"{name}#{anchor[1]}", f"{name} has no heading #{anchor[1]}"

    def module_problem(self, name: str) -> str | None:
        """Why the dotted ``name`` (``shims.openai_*``: a module name's prefix) is not a module of this repository or
        an attribute of one, or None. A name that a package holds neither as a module nor as a subpackage must at
        least appear in its ``__init__.py`` (what it re-exports)."""
        parts = name.split(".")
        path = self.root / parts[0]
        for depth, part in enumerate(parts[1:], 2):
            if part.endswith("*"):
                found = any(entry.name.startswith(part[:-1]) for entry in path.iterdir())
                return None if found else f"no module {'.'.join(parts[:depth])}"
            if (path / part).is_dir():
                path = path / part
            elif (path / f"{part}.py").is_file():
                return None  # a module: what follows are its attributes
            elif (init := path / "__init__.py").is_file() and re.search(rf"\b{part}\b", init.read_text()):
                return None
            else:
                return f"no module {'.'.join(parts[:depth])}"
        return None


@dataclass(frozen=True)
class PythonFile:
    """A Python file's strings and comments: the prose its names are in."""

    name: str
    parts: list[re.Match[str]]

    @classmethod
    def read(cls, root: Path, path: Path) -> PythonFile:
        return cls(path.relative_to(root).as_posix(), list(_STRING_OR_COMMENT.finditer(path.read_text())))

    @property
    def strings(self) -> Iterator[str]:
        """The text between the quotes of each string literal."""
        for part in self.parts:
            if quoted := _PREFIX_AND_QUOTES.match(part.group()):
                yield quoted[2]

    def prose(self) -> str:
        """Its strings and comments, each on its own line, and none of its code: a variable named like a package
        (``adapters.append``) is not a name to check."""
        pieces, end = [], 0
        for part in self.parts:
            pieces += ["\n" * part.string.count("\n", end, part.start()), " ", part.group(), " "]
            end = part.end()
        return "".join(pieces)


def _headings(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as MkDocs (Python-Markdown's toc) and GitHub both make them: the
    README links into the manual's pages by them, and MkDocs' strict build does not read the README."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.M):
        text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
        slugs.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower()))
    return slugs


def _either(names: set[str]) -> str:
    return "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
