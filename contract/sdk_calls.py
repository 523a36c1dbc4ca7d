"""Every HTTP route the installed tinker SDK (and its ``tinker`` CLI) can call, found by reading its source.

The SDK's route strings sit in calls such as ``client.post("/api/v1/…")``, ``self._get(f"/api/v1/x/{id}")`` or
``self._request("GET", "/api/v1/…")``; the method comes from the call. Test files of the package are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}


def _template(node: ast.expr) -> str | None:
    """The route of a string literal or f-string, with each interpolation written ``{name}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        text = "".join(part.value if isinstance(part, ast.Constant) else "{" + ast.unparse(part.value) + "}"
                       for part in node.values)
    else:
        return None
    return text if text.startswith("/api/v1/") else None


def _method(call: ast.Call) -> str | None:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    name = name.lstrip("_").lower()
    if name in METHODS:
        return METHODS[name]
    if name == "request" and call.args and isinstance(call.args[0], ast.Constant):
        return str(call.args[0].value).upper()
    return None


def sdk_routes() -> list[dict[str, str]]:
    """``{"method", "path", "file"}`` of every route call in the installed tinker package, sorted."""
    import tinker

    root = Path(tinker.__file__).parent
    found: dict[tuple[str, str], str] = {}
    for source in sorted(root.rglob("*.py")):
        if source.name.endswith("_test.py"):
            continue
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if not isinstance(node, ast.Call) or (method := _method(node)) is None:
                continue
            for arg in node.args:
                if (path := _template(arg)) is not None:
                    found.setdefault((method, path), source.relative_to(root).as_posix())
    return [{"method": m, "path": p, "file": f} for (m, p), f in sorted(found.items())]
