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
from urllib.parse import unquote

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


# ---- schemas that admit no finite value ---------------------------------------------------------------------------

class _Gates:
    """A monotone AND/OR circuit over a schema: one gate per schema reached from the root, and the gates its
    conditions combine. A gate holds once every input (AND) or any input (OR) holds; ``settle`` finds every gate that
    holds, linear in the circuit's size however the ``$ref`` cycles run (a least fixed point: a cycle holds only
    where something outside it lets it end)."""

    def __init__(self) -> None:
        self.missing: list[int] = []
        """Per gate, how many more inputs it needs to hold."""
        self.users: list[list[int]] = []
        self.holds: list[bool] = []

    def add(self, kind: str, inputs: list[int]) -> int:
        gate = len(self.missing)
        self.missing.append(len(inputs) if kind == "and" else 1)
        self.users.append([])
        self.holds.append(False)
        for source in inputs:
            self.users[source].append(gate)
        return gate

    def settle(self) -> None:
        ready = [gate for gate, missing in enumerate(self.missing) if missing == 0]
        while ready:
            gate = ready.pop()
            if self.holds[gate]:
                continue
            self.holds[gate] = True
            for user in self.users[gate]:
                self.missing[user] -= 1
                if self.missing[user] == 0:
                    ready.append(user)


def _resolve(root: Any, ref: Any) -> tuple[str, Any] | None:
    """The schema a local ``$ref`` (``#`` or a JSON pointer ``#/…``) names, with its path as ``unsupported_features``
    writes paths; None for any other reference (an anchor, another document) or a pointer to nothing."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node, names = root, []
    for part in ref[2:].split("/") if ref != "#" else []:
        name = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and name in node:
            node = node[name]
        elif isinstance(node, list) and name.isdigit() and int(name) < len(node):
            node = node[int(name)]
        else:
            return None
        names.append(name)
    return ".".join(names) or "the root", node


def admits_nothing(schema: Any) -> str | None:
    """Why no finite JSON value satisfies ``schema``, or None when one may. What is caught is what the grammar engine
    does not refuse itself: a ``$ref`` recursion with no base case (``{"$ref": "#"}``, definitions that each need
    another without end), whose grammar admits no text at all, or only an infinitely nested one.

    Conservative: only what no value can satisfy is named, however the engine reads the rest. A keyword whose
    type the schema does not fix admits any value of another type; ``not``, ``if`` and the ranges are not read;
    a reference this cannot follow admits anything."""
    gates, made, targets = _Gates(), {}, {}
    always = gates.add("and", [])

    def gate_of(node: Any) -> int:
        if node is False:
            return gates.add("or", [])
        if not isinstance(node, dict):
            return always
        if id(node) not in made:
            made[id(node)] = gates.add("and", [])  # a placeholder, wired below; cycles reach it meanwhile
            wiring.append(node)
        return made[id(node)]

    def type_gate(node: dict[str, Any]) -> int | None:
        """What the node's ``type`` needs of its children; None when it needs nothing (a type that may be a
        scalar, or none given)."""
        types = _types(node)
        if not types or types - {"object", "array"}:
            return None
        options = []
        if "object" in types:
            properties, required = node.get("properties"), node.get("required")
            needed = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
            options.append(gates.add("and", [gate_of(properties[name]) for name in dict.fromkeys(needed)
                                             if isinstance(properties, dict) and name in properties]))
        if "array" in types:
            least = node.get("minItems", 0)
            prefix = node.get("prefixItems", node.get("items"))
            prefix = prefix if isinstance(prefix, list) else []
            rest = node.get("items") if "prefixItems" in node or not isinstance(node.get("items"), list) else None
            needed = [gate_of(item) for item in prefix[:least]] if isinstance(least, int) else []
            if isinstance(least, int) and least > len(prefix) and isinstance(rest, (dict, bool)):
                needed.append(gate_of(rest))
            options.append(gates.add("and", needed))
        return gates.add("or", options)

    wiring: list[dict[str, Any]] = []
    root = gate_of(schema)
    while wiring:
        node = wiring.pop()
        needs = []
        if "$ref" in node:
            target = _resolve(schema, node["$ref"])
            if target is not None:
                targets.setdefault(id(target[1]), target)
                needs.append(gate_of(target[1]))
        if isinstance(node.get("allOf"), list):
            needs += [gate_of(child) for child in node["allOf"]]
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key]:
                needs.append(gates.add("or", [gate_of(child) for child in node[key]]))
        if isinstance(node.get("enum"), list) and not node["enum"]:
            needs.append(gates.add("or", []))
        if (by_type := type_gate(node)) is not None:
            needs.append(by_type)
        placeholder = made[id(node)]
        gates.missing[placeholder] = len(needs)
        for source in needs:
            gates.users[source].append(placeholder)
    gates.settle()
    if gates.holds[root]:
        return None
    endless = [path for key, (path, _) in targets.items() if not gates.holds[made.get(key, always)]]
    if not endless:
        return "admits no value"
    return (f"admits no finite value: {', '.join(endless)} can only be satisfied by a value that contains another "
            f"such value, without end (a $ref recursion with no base case)")
