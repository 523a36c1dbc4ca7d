"""What one session's fields may hold (``--max-session-field-chars``, ``--max-session-tags``,
``--max-session-metadata-bytes``): declared here once, each with its default, help and check (``shims.option``),
apart from the session service, so that the CLI reads them without importing the tinker SDK.
``compat_server.config.ServerConfig`` holds them as ``sessions``; the session service is given them whole."""

from __future__ import annotations

from dataclasses import dataclass

from shims.option import at_least, option


@dataclass(frozen=True)
class SessionLimits:
    """Session search answers up to 200 sessions a page (the SDK's ``SessionSearchRequest.limit``, checked as the
    request is decoded) with their display name, project and metadata, so these bound every page; unbounded, one
    key's 8 MiB names made a page of hundreds of MiB."""

    field_chars: int = option(
        256, flag="--max-session-field-chars", check=at_least(1),
        help="longest display_name, project_id, sdk_version and tag a session may be given, in characters; a longer "
             "one is refused when the session is created or assigned to a project (default: %(default)s)")
    tags: int = option(64, "most tags one session may carry (the SDK sends TINKER_TAGS) (default: %(default)s)",
                       flag="--max-session-tags", check=at_least(0))
    metadata_bytes: int = option(
        16384, flag="--max-session-metadata-bytes", check=at_least(2),
        help="largest user_metadata one session may carry, in bytes of its JSON text; session search answers up to "
             "200 sessions a page, each with its metadata (default: %(default)s)")
