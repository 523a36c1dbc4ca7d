"""Options of adapter uploads (``external_weights_upload_start`` / PUT / ``…_finish``): declared here once, each with
its default, help and check (``shims.option``), apart from the upload service, so that the CLI reads them without
importing the tinker SDK. ``compat_server.config.ServerConfig`` holds them as ``uploads``."""

from __future__ import annotations

from dataclasses import dataclass

from shims.option import ABOVE_ZERO, at_least, option


@dataclass(frozen=True)
class UploadOptions:
    """Hosted Tinker gates uploads per server ("upload support is gated by the server"); here they are on unless
    turned off. An open upload may hold up to one adapter's files on disk, so a key holds few at once."""

    enabled: bool = option(
        True, flag="--no-external-uploads",
        help="refuse adapter uploads (RestClient.external_weights_upload_start, SDK 0.39): keys can then only train "
             "adapters here, not bring their own")
    ttl: float = option(
        3600.0, flag="--upload-ttl", check=ABOVE_ZERO,
        help="seconds an adapter upload stays open: its signed PUT URLs expire then, and its files are deleted "
             "unless it was finished (default: %(default)s)")
    max_open_per_key: int = option(
        4, flag="--max-open-uploads-per-key", check=at_least(1),
        help="most unfinished adapter uploads one API key may have at once; each may hold up to one adapter's files "
             "(default: %(default)s)")
