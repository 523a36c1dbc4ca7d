"""The JSON-schema features that constrained decoding cannot enforce, found before a request is sampled.

xgrammar (the grammar engine of both sampler backends) compiles some schema keywords by ignoring them: a
``multipleOf`` or ``uniqueItems`` would not hold in the output, and a two-branch ``allOf`` would let any JSON
through. vLLM's xgrammar backend refuses such schemas; the transformers sampler, calling xgrammar directly, would
have accepted them and produced output that does not validate. This module names them, so that both backends refuse
the same schemas with the same 400 and every output that is produced validates. The list follows xgrammar 0.2.8's
open issues (#937, #958-#968), as vLLM 0.32 checks them. Pure: nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer",
})
"""The string ``format`` values xgrammar turns into a grammar."""


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {item for item in kind if isinstance(item, str)} if isinstance(kind, list) else set()


def _bounded_pattern(node: dict[str, Any]) -> bool:
    """A ``pattern`` or ``format`` together with a length bound: xgrammar drops the bound."""
    return ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node)


def _problems_here(node: dict[str, Any]) -> Iterator[str]:
    """This schema's own problems. A keyword whose schema gives no ``type`` counts as if it named its type: xgrammar
    enforces it no better there."""
    types = _types(node)

    def typed(kind: str) -> bool:
        return not types or kind in types

    if (typed("integer") or typed("number")) and "multipleOf" in node:
        yield "multipleOf"
    if typed("array"):
        yield from (key for key in ("uniqueItems", "contains", "minContains", "maxContains") if key in node)
    if typed("string"):
        if isinstance(node.get("format"), str) and node["format"] not in STRING_FORMATS:
            yield f"format {node['format']!r}"
        if _bounded_pattern(node):
            yield "minLength/maxLength with a pattern or format"
    if typed("object"):
        names, patterns = node.get("propertyNames"), node.get("patternProperties")
        if "propertyNames" in node and (
                (isinstance(names, dict) and _bounded_pattern(names)) or "patternProperties" in node
                or "properties" in node or node.get("unevaluatedProperties", True) is not True):
            yield "propertyNames with properties, patternProperties, unevaluatedProperties or a bounded pattern"
        if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
            yield "patternProperties with properties, or more than one pattern"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
        yield "allOf with more than one branch"


SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose value maps names to schemas."""
SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
"""Keywords whose value is a list of schemas (``items`` too, in its older form)."""
SCHEMA_VALUES = frozenset({"items", "additionalProperties", "additionalItems", "unevaluatedProperties",
                           "unevaluatedItems", "contains", "propertyNames", "not", "if", "then", "else"})
"""Keywords whose value is one schema. Anything else (``enum``, ``const``, ``default``, ``examples``…) is data and
is not searched: a ``default`` that happens to hold ``"multipleOf"`` says nothing about the output."""


def _subschemas(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            yield from ((f"{key}.{name}", child) for name, child in value.items())
        elif key in SCHEMA_LISTS and isinstance(value, list):
            yield from ((f"{key}.{i}", child) for i, child in enumerate(value))
        elif key in SCHEMA_VALUES and isinstance(value, dict):
            yield key, value


def unsupported_features(schema: Any, where: str = "") -> list[str]:
    """Each feature of ``schema`` that constrained decoding could not enforce, as ``"<feature> at <path>"`` (the
    path in the schema, "the root" for its top); an empty list when the output will follow the whole schema.

    vLLM's own check (``has_xgrammar_unsupported_json_features``) also searches data such as ``default`` values, so
    the vLLM sampler may still refuse a schema this passes, with vLLM's message."""
    if not isinstance(schema, dict):
        return []
    found = [f"{problem} at {where or 'the root'}" for problem in _problems_here(schema)]
    for key, child in _subschemas(schema):
        found += unsupported_features(child, f"{where}.{key}" if where else key)
    return found
