"""Error types shared by every layer."""


class UserError(ValueError):
    """The caller's request is wrong; the message says what to change.

    Surfaces as a future failed with category ``user`` (the tinker SDK raises ``RequestFailedError``) or as a 4xx.
    Anything else raised while serving a request is reported as a ``server`` error.
    """


class NotFound(UserError):
    """Names an object that does not exist or that this tenant may not see; answered as 404 either way, so another
    tenant's objects are never revealed."""
