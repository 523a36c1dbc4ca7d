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
    types = _types(node)
    if types & {"integer", "number"} and "multipleOf" in node:
        yield "multipleOf"
    if "array" in types:
        yield from (key for key in ("uniqueItems", "contains", "minContains", "maxContains") if key in node)
    if "string" in types:
        if "format" in node and node["format"] not in STRING_FORMATS:
            yield f"format {node['format']!r}"
        if _bounded_pattern(node):
            yield "minLength/maxLength with a pattern or format"
    if "object" in types:
        names, patterns = node.get("propertyNames"), node.get("patternProperties")
        if "propertyNames" in node and (
                (isinstance(names, dict) and _bounded_pattern(names)) or "patternProperties" in node
                or "properties" in node or node.get("unevaluatedProperties", True) is not True):
            yield "propertyNames with properties, patternProperties, unevaluatedProperties or a bounded pattern"
        if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
            yield "patternProperties with properties, or more than one pattern"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
        yield "allOf with more than one branch"


def unsupported_features(schema: Any, where: str = "") -> list[str]:
    """Each feature of ``schema`` that constrained decoding could not enforce, as ``"<feature> at <path>"`` (the
    path in the schema, empty at its root); an empty list when the output will follow the whole schema."""
    found: list[str] = []
    if isinstance(schema, dict):
        found += [f"{problem} at {where or 'the root'}" for problem in _problems_here(schema)]
        children = schema.items()
    elif isinstance(schema, list):
        children = ((str(i), item) for i, item in enumerate(schema))
    else:
        return found
    for key, child in children:
        if isinstance(child, dict | list):
            found += unsupported_features(child, f"{where}.{key}" if where else str(key))
    return found
