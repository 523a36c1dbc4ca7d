"""Generate (or check) the pinned wire contract from the installed tinker and openai SDKs.

    python -m contract.generate          # rewrite contract/pinned/*.json
    python -m contract.generate --check  # exit 1 and show what differs if the installed SDK drifted
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

PINNED = Path(__file__).parent / "pinned"


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


def generate() -> dict[str, object]:
    import openai
    import tinker

    from contract.routes import TINKER_ROUTES
    from contract.sdk_calls import sdk_routes

    return {
        "tinker_sdk_calls.json": {"sdk_version": tinker.__version__, "calls": sdk_routes()},
        "tinker_routes.json": {"sdk_version": tinker.__version__, "routes": [asdict(r) for r in TINKER_ROUTES]},
        "tinker_schemas.json": {"sdk_version": tinker.__version__, "schemas": json_schemas()},
        "tinker_protobuf.json": {"sdk_version": tinker.__version__, "descriptor": protobuf_descriptor()},
        "openai_schemas.json": {"sdk_version": openai.__version__, "routes": OPENAI_ROUTES,
                                "schemas": openai_schemas()},
    }


def render(content: object) -> str:
    return json.dumps(content, indent=1, sort_keys=True) + "\n"


def drift() -> list[str]:
    """Names of pinned files that differ from what the installed SDK generates now."""
    return [name for name, content in generate().items()
            if not (PINNED / name).exists() or (PINNED / name).read_text() != render(content)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if args.check:
        changed = drift()
        if changed:
            print("pinned contract differs from the installed tinker SDK:", ", ".join(changed))
            sys.exit(1)
        print("pinned contract matches the installed tinker SDK")
        return
    PINNED.mkdir(exist_ok=True)
    for name, content in generate().items():
        (PINNED / name).write_text(render(content))
        print("wrote", PINNED / name)


if __name__ == "__main__":
    main()
