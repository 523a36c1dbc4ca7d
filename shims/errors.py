"""Error types shared by every layer."""


class UserError(ValueError):
    """The caller's request is wrong; the message says what to change.

    Surfaces as a future failed with category ``user`` (the tinker SDK raises ``RequestFailedError``) or as a 4xx.
    Anything else raised while serving a request is reported as a ``server`` error.
    """


class NotFound(UserError):
    """Names an object that does not exist or that this tenant may not see; answered as 404 either way, so another
    tenant's objects are never revealed."""


class ConfigurationRefused(RuntimeError):
    """The server cannot run as the operator configured it (a model a backend cannot serve, resources the cluster
    lacks); the message says what to change. Raised while the server starts, which then ends with that message alone,
    before it binds its port."""


def too_deeply_nested(exc: BaseException) -> UserError | None:
    """The user error for a request body nested deeper than the JSON decoder recurses (200,000 levels of ``[`` fit
    in a few hundred KB), or None when ``exc`` is something else. The decoder raises ``RecursionError`` "… while
    deserializing"; a ``RecursionError`` from anywhere else stays a server error."""
    if isinstance(exc, RecursionError) and "deserializ" in str(exc):
        return UserError("the request body is nested too deeply to decode; JSON bodies here are a few levels deep")
    return None
