"""The server's commands of ``psgrad``: ``serve`` (api + embedded workers) and ``worker``.

The ``psgrad`` command belongs to the light client (:mod:`psgrad._cli`); this module is
registered under its ``psgrad.commands`` entry-point group, so the command gains ``serve`` and
``worker`` where the server is installed. The server's dependencies (torch, fastapi,
pydantic-settings) are imported only when one of them runs, so the client commands stay fast.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.config import Settings

log = logging.getLogger("psgrad.serve")

EXIT_OK = 0
EXIT_REFUSED = 2
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def serve(
    host: str | None = None,
    port: int | None = None,
    *,
    insecure_no_auth: bool = False,
    workers: int | None = None,
    log_level: str = "info",
    settings: Settings | None = None,
) -> int:
    """Run the api under uvicorn; without ``PSGRAD_REDIS_URL`` it also runs the worker threads.

    ``host`` and ``port`` default to ``PSGRAD_LISTEN_HOST`` (loopback) and
    ``PSGRAD_LISTEN_PORT``. With no keys configured it refuses a non-loopback ``host`` unless
    ``insecure_no_auth``.
    """
    import uvicorn

    from service.api import create_app
    from service.config import get_settings

    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    settings = settings or get_settings()
    host = settings.listen_host if host is None else host
    port = settings.listen_port if port is None else port
    settings = settings.model_copy(update={"listen_port": port})  # its data folder's name
    if workers is not None:
        settings = settings.model_copy(update={"workers": workers})
    if not settings.keys_configured:
        if not is_loopback(host) and not insecure_no_auth:
            log.error(
                "refusing to serve on %s without API keys: anyone who reaches it could use it. "
                "Set PSGRAD_API_KEYS (and PSGRAD_ADMIN_KEYS), bind to 127.0.0.1, or pass "
                "--insecure-no-auth if a proxy in front of it authenticates",
                host,
            )
            return EXIT_REFUSED
        log.warning(
            "no API keys configured (PSGRAD_API_KEYS): running WITHOUT authentication on %s", host
        )
    mode = (
        "redis at " + settings.redis_url
        if settings.redis_url
        else (f"embedded broker, {settings.workers} worker thread(s)")
    )
    log.info("psgrad api on http://%s:%d (%s)", host, port, mode)
    from service.keyring import KeysError

    try:
        app = create_app(settings)
    except KeysError as exc:
        log.error("%s", exc)
        return EXIT_REFUSED
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    uvicorn.Server(config).run()
    return EXIT_OK


def worker(device: str = "auto") -> int:
    """``psgrad worker``: one Redis worker process (:mod:`service.worker_process`)."""
    from service.worker_process import worker as run_worker

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    return run_worker(device)


def add_commands(sub: Any) -> None:
    """Add ``serve`` and ``worker`` to the ``psgrad`` subcommand parsers."""
    p = sub.add_parser(
        "serve",
        help="run the HTTP api (with worker threads unless PSGRAD_REDIS_URL is set)",
        description="Run the HTTP api. Without PSGRAD_REDIS_URL jobs run in "
        "worker threads of this process (embedded broker). Settings come from "
        "PSGRAD_* environment variables.",
    )
    p.add_argument("--host", default=None,
                   help="interface to bind (default: PSGRAD_LISTEN_HOST, else 127.0.0.1)")
    p.add_argument("--port", type=_port, default=None,
                   help="port (default: PSGRAD_LISTEN_PORT, else 8000)")
    p.add_argument("--workers", type=int, default=None,
                   help="embedded worker threads (default: PSGRAD_WORKERS, 1)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback host without API keys (e.g. behind an "
                   "authenticating proxy)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p = sub.add_parser("worker", help="run one worker process against PSGRAD_REDIS_URL")
    p.add_argument("--device", default="auto",
                   help="cuda:0, cuda, cpu or auto (CUDA when available); one per process")


def _port(text: str) -> int:
    """A TCP port, 1 to 65535 (a larger number wrapped around to another port)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535; got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    """Run ``serve`` or ``worker``, parsed by :func:`add_commands`; a setting that cannot be
    read is one line per setting (exit 2), not pydantic's report."""
    from pydantic import ValidationError

    from service.config import get_settings
    from service.process_env import configure

    try:
        get_settings()
    except ValidationError as exc:
        for e in exc.errors():
            name = "PSGRAD_" + "_".join(str(x) for x in e["loc"]).upper()
            print(f"psgrad: error: {name}: {e['msg']}; got {e.get('input')!r}", file=sys.stderr)
        return 2
    configure()  # huge pages, idle BLAS threads asleep, freed memory kept: before any work
    if args.command == "worker":
        return worker(args.device)
    return serve(args.host, args.port, insecure_no_auth=args.insecure_no_auth,
                 workers=args.workers, log_level=args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    """The whole ``psgrad`` command (the client's, with these commands), for ``python -m``."""
    from psgrad._cli import build_parser

    args = build_parser([sys.modules[__name__]]).parse_args(argv)
    if args.command in ("serve", "worker"):
        return run(args)
    from psgrad._cli_client import run as run_client

    return run_client(args, argv)


if __name__ == "__main__":
    sys.exit(main())
