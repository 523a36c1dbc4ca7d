"""The ``compat-server`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from adapters.logs import ENV as LOG_FORMAT_ENV
from adapters.logs import configure_logging
from compat_server.cli.options import config_from_args, defaults_from_environment, serve_parser
from compat_server.config import ServerConfig, default_data_dir
from shims.errors import ConfigurationRefused

if TYPE_CHECKING:
    from compat_server.services import Services

log = logging.getLogger("compat_server")


def build_parser() -> argparse.ArgumentParser:
    serve_help = serve_parser(argparse.ArgumentParser(prog="compat-server serve", add_help=False)).format_help()
    parser = argparse.ArgumentParser(
        prog="compat-server",
        description="Self-hosted, drop-in server for the Tinker fine-tuning API. Point the tinker SDK at it with "
                    "TINKER_BASE_URL=http://HOST:PORT and any TINKER_API_KEY starting with 'tml-'.",
        epilog="Options of 'compat-server serve':\n" + serve_help[serve_help.index("options:") + 9:],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser(commands.add_parser("serve", help="start the server (see options below)"))
    keys = commands.add_parser("keys", help="manage API keys for --auth keys: create, list, revoke")
    keys.add_argument("--data-dir", type=Path, default=default_data_dir(),
                      help="the server's data directory (default: %(default)s)")
    defaults_from_environment(keys)
    actions = keys.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="make a new key and print it once (only its hash is stored)")
    create.add_argument("--name", required=True, help="a unique name to list and revoke the key by")
    create.add_argument("--admin", action="store_true",
                        help="an operator key: GET /api/v1/metrics and the dashboard show it server-wide figures (all "
                             "tenants' counts, latencies, drift, sampler replicas, trainer batches) instead of its "
                             "own; works with --auth open too")
    actions.add_parser("list", help="list keys: name, id, created, role (admin or tenant), revoked")
    revoke = actions.add_parser("revoke", help="revoke a key at once; its requests are refused with 401")
    revoke.add_argument("key", metavar="NAME_OR_ID")
    return parser


def manage_keys(args: argparse.Namespace) -> int:
    """``compat-server keys …``: works beside a running server (SQLite WAL); revocation applies to its next request."""
    import secrets

    from compat_server.access.auth import new_key, owner_of
    from compat_server.records import CorruptRecords, Records

    try:
        records = Records(args.data_dir.expanduser().resolve() / ServerConfig.RECORDS_FILE)
    except CorruptRecords as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.action == "create":
        key = new_key()
        try:
            records.tenants.add_key(secrets.token_hex(6), args.name, owner_of(key), admin=args.admin)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(key)
        print(f"key {args.name!r} created; it is shown only this once", file=sys.stderr)
    elif args.action == "list":
        for row in records.tenants.api_keys():
            state = f"revoked {row['revoked']}" if row["revoked"] else "active"
            print(f"{row['name']}\t{row['id']}\tcreated {row['created']}\t{'admin' if row['admin'] else 'tenant'}\t"
                  f"{state}")
    elif not records.tenants.revoke_key(args.key):
        print(f"error: no active key named or with id {args.key!r}", file=sys.stderr)
        return 1
    else:
        print(f"key {args.key!r} revoked", file=sys.stderr)
    return 0


def serve(config: ServerConfig) -> None:
    import uvicorn

    from compat_server.app import create_app
    from compat_server.records import CorruptRecords, check_integrity
    from compat_server.services import start_services

    config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        check_integrity(config.records_path)
    except CorruptRecords as exc:
        log.error("%s", exc, extra={"event": "records_corrupt", "path": str(config.records_path)})
        sys.exit(2)

    async def run() -> bool:
        # Started before the HTTP server (which binds the port only once they are up), so that a configuration
        # they refuse is said in one line rather than inside a lifespan traceback.
        try:
            services = await start_services(config)
        except ConfigurationRefused as exc:
            log.error("compat-server cannot start: %s", exc, extra={"event": "start_refused"})
            import ray

            if ray.is_initialized():
                ray.shutdown()
            return False
        server = uvicorn.Server(uvicorn.Config(
            create_app(config, services), host=config.host, port=config.port, log_level=config.log_level.lower(),
            access_log=config.access_log, lifespan="on", timeout_graceful_shutdown=5,
            timeout_keep_alive=config.keep_alive_seconds,
            log_config=None,  # uvicorn's lines go through the server's own handler, in its format (text or JSON)
        ))
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host = f"[{config.host}]" if ":" in config.host else config.host
            url = f"http://{host}:{config.port}"
            auth = config.auth_mode
            if auth == "open":
                auth += " (each tml- key is its own tenant; no key, EMPTY or any other key share one anonymous tenant)"
            threads = torch_threads(services)
            log.info("compat-server ready at %s — base models: %s — torch threads: %s — data: %s — auth: %s", url,
                     ", ".join(config.base_models), _said(threads), config.data_dir, auth,
                     extra={"event": "ready", "url": url, "base_models": config.base_models,
                            "auth": config.auth_mode, "torch_threads": threads})
        await task
        return server.started

    if not asyncio.run(run()):
        sys.exit(1)


def torch_threads(services: Services) -> dict[str, dict[str, list[int]]]:
    """Per base model, the torch threads each trainer process (each shard) and each sampler worker computes with,
    as read inside them (``adapters.cpu_threads``)."""
    return {name: {"trainer": [f.threads for f in group.facts],
                   "samplers": services.samplers.torch_threads.get(name, [])}
            for name, group in services.trainers.groups.items()}


def _said(threads: dict[str, dict[str, list[int]]]) -> str:
    """``trainer 2, samplers 2`` (one base model), each model named where there are several."""
    def one(counts: dict[str, list[int]]) -> str:
        return ", ".join(f"{who} {'+'.join(map(str, n))}" for who, n in counts.items() if n)
    if len(threads) == 1:
        return one(next(iter(threads.values())))
    return "; ".join(f"{name}: {one(counts)}" for name, counts in threads.items())


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return
    if args.command == "keys":
        sys.exit(manage_keys(args))
    os.environ[LOG_FORMAT_ENV] = args.log_format  # the Ray actors log in the same format
    configure_logging(args.log_level, args.log_format)
    # Quiet third-party progress bars in the server and in the Ray workers it starts (they inherit the environment).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    serve(config)


if __name__ == "__main__":
    main()
