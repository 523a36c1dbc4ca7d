"""Generate (or check) the pinned wire contract from the installed tinker and openai SDKs.

    python -m contract.generate          # rewrite contract/pinned/*.json
    python -m contract.generate --check  # exit 1 and show the diff if the installed SDKs changed the wire

Each pinned file records the SDK version it was generated from (``sdk_version``). That number is a record, not part
of the contract, and so are the schemas' titles and descriptions: a newer SDK whose schemas, routes and protobuf
descriptor accept and produce the same JSON passes the check, and only a change on the wire fails it, with a unified
diff of what changed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

PINNED = Path(__file__).parent / "pinned"
VERSION_KEY = "sdk_version"
"""The key under which a pinned file records the version of the SDK it was generated from."""


def type_names() -> list[str]:
    from contract.routes import FUTURE_STATES, TINKER_ROUTES

    names = {n for r in TINKER_ROUTES for n in (r.request, r.response, r.future_result) if n}
    return sorted(n for n in names | set(FUTURE_STATES) if not n.startswith("protobuf:"))


def json_schemas() -> dict:
    """Validation-mode JSON schema of every SDK type a pinned route uses: what the SDK accepts and sends."""
    import importlib
    import re

    def sdk_type(name: str):
        module = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
        try:
            return getattr(importlib.import_module("tinker.types"), name)
        except AttributeError:  # a few types are only importable from their own module
            return getattr(importlib.import_module(f"tinker.types.{module}"), name)

    return {name: sdk_type(name).model_json_schema(mode="validation") for name in type_names()}


def protobuf_descriptor() -> dict:
    """The SDK's ``tinker_public.proto`` as a plain dict of its FileDescriptorProto."""
    from google.protobuf import descriptor_pb2
    from google.protobuf.json_format import MessageToDict
    from tinker.proto import tinker_public_pb2

    proto = descriptor_pb2.FileDescriptorProto()
    tinker_public_pb2.DESCRIPTOR.CopyToProto(proto)
    return MessageToDict(proto, preserving_proto_field_name=True)


OPENAI_ROUTES = ["GET /v1/models", "GET /v1/models/{model}", "POST /v1/chat/completions", "POST /v1/completions"]
OPENAI_TYPES = {
    "ChatCompletion": "openai.types.chat", "ChatCompletionChunk": "openai.types.chat", "Completion": "openai.types",
    "Model": "openai.types", "ErrorObject": "openai.types.shared",
}


def openai_schemas() -> dict:
    """Serialization-mode schemas of the ``openai`` SDK's response types the ``/v1`` routes answer with."""
    import importlib

    return {name: getattr(importlib.import_module(module), name).model_json_schema(mode="serialization")
            for name, module in OPENAI_TYPES.items() if module}


def generate() -> dict[str, dict]:
    """Each pinned file's content by name; each file is generated from the SDK its name starts with."""
    import openai
    import tinker

    from contract.routes import TINKER_ROUTES
    from contract.sdk_calls import sdk_routes

    tinker_version = {VERSION_KEY: tinker.__version__}
    return {
        "tinker_sdk_calls.json": {**tinker_version, "calls": sdk_routes()},
        "tinker_routes.json": {**tinker_version, "routes": [asdict(r) for r in TINKER_ROUTES]},
        "tinker_schemas.json": {**tinker_version, "schemas": json_schemas()},
        "tinker_protobuf.json": {**tinker_version, "descriptor": protobuf_descriptor()},
        "openai_schemas.json": {VERSION_KEY: openai.__version__, "routes": OPENAI_ROUTES, "schemas": openai_schemas()},
    }


def sdk_of(name: str) -> str:
    """The SDK a pinned file is generated from: the start of its name."""
    return name.split("_")[0]


def render(content: object) -> str:
    return json.dumps(content, indent=1, sort_keys=True) + "\n"


ANNOTATIONS = frozenset({"title", "description", "examples", "$comment"})
"""JSON Schema keywords that document a schema without changing what it accepts: a release that rewords a docstring
or a documentation link changes only these."""
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose value maps names (a property named ``title``, say) to subschemas."""
DATA = frozenset({"default", "const", "enum"})
"""Keywords whose value is data, not a schema."""


def without_annotations(schema: object) -> object:
    """The schema as the wire sees it: every annotation keyword removed, at every depth."""
    if isinstance(schema, list):
        return [without_annotations(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in DATA:
            kept[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            kept[key] = {name: without_annotations(subschema) for name, subschema in value.items()}
        else:
            kept[key] = without_annotations(value)
    return kept


def wire(content: dict) -> dict:
    """What a pinned file pins: its content without the SDK version it was generated from, its JSON schemas without
    their documentation."""
    return {key: {name: without_annotations(schema) for name, schema in value.items()} if key == "schemas" else value
            for key, value in content.items() if key != VERSION_KEY}


def read_pinned(names: Iterable[str], pinned: Path = PINNED) -> dict[str, dict | None]:
    """The named pinned files' contents (``None`` where a file is missing)."""
    return {name: json.loads((pinned / name).read_text()) if (pinned / name).exists() else None for name in names}


def differences(generated: dict | None = None, pinned: Path = PINNED, max_lines: int = 400) -> dict[str, str]:
    """A unified diff (pinned → installed) of each pinned file whose wire content differs from what the installed SDKs
    generate now; a file that differs only in its recorded SDK version is not listed."""
    generated = generate() if generated is None else generated
    found = {}
    for name, was in read_pinned(generated, pinned).items():
        now = wire(generated[name])
        if was is not None and wire(was) == now:
            continue
        sdk = sdk_of(name)
        pinned_label = f"{name} as pinned ({sdk} {was.get(VERSION_KEY)})" if was is not None else f"{name} (missing)"
        lines = list(difflib.unified_diff(render(wire(was)).splitlines() if was is not None else [],
                                          render(now).splitlines(), pinned_label,
                                          f"{name} from the installed {sdk} {generated[name][VERSION_KEY]}",
                                          lineterm=""))
        if len(lines) > max_lines:
            lines = lines[:max_lines] + [f"… {len(lines) - max_lines} more diff lines"]
        found[name] = "\n".join(lines)
    return found


def version_changes(generated: dict | None = None, pinned: Path = PINNED) -> dict[str, tuple[str | None, str]]:
    """``{name: (recorded version, installed version)}`` for pinned files generated from another SDK version."""
    generated = generate() if generated is None else generated
    return {name: (was.get(VERSION_KEY), generated[name][VERSION_KEY])
            for name, was in read_pinned(generated, pinned).items()
            if was is not None and was.get(VERSION_KEY) != generated[name][VERSION_KEY]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--pinned", type=Path, default=PINNED,
                        help="the directory of pinned files (default: %(default)s)")
    args = parser.parse_args(argv)
    generated = generate()
    if args.check:
        changed = differences(generated, args.pinned)
        for name, (was, now) in version_changes(generated, args.pinned).items():
            sdk = sdk_of(name)
            print(f"{name}: generated from {sdk} {was}, installed {sdk} {now}"
                  + ("" if name in changed else ": the wire is unchanged (regenerate to record the new version)"))
        for diff in changed.values():
            print(diff)
        if changed:
            print("the wire contract differs from the installed SDKs:", ", ".join(changed))
            sys.exit(1)
        print("the wire contract matches the installed SDKs")
        return
    args.pinned.mkdir(exist_ok=True)
    for name, content in generated.items():
        (args.pinned / name).write_text(render(content))
        print("wrote", args.pinned / name)


if __name__ == "__main__":
    main()
