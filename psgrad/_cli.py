"""The ``psgrad`` command.

``serve`` and ``worker`` run the server (they import torch and fastapi, only when they run);
the client commands (``models``, ``grads``: :mod:`psgrad._cli_client`) need only the light SDK.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _serve(args: argparse.Namespace) -> int:
    # Transparent huge pages for CPU tensors (docs/operations.md): set before torch allocates.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from service.cli import serve

    return serve(
        args.host,
        args.port,
        insecure_no_auth=args.insecure_no_auth,
        workers=args.workers,
        log_level=args.log_level,
    )


def _worker(args: argparse.Namespace) -> int:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from service.cli import worker

    return worker(args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psgrad",
        description="Per-sample gradients as a service: run the server, or use "
        "one (PSGRAD_URL, PSGRAD_API_KEY).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "serve",
        help="run the HTTP api (with worker threads unless PSGRAD_REDIS_URL is set)",
        description="Run the HTTP api. Without PSGRAD_REDIS_URL jobs run in "
        "worker threads of this process (embedded broker). Settings come from "
        "PSGRAD_* environment variables.",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="embedded worker threads (default: PSGRAD_WORKERS, 1)",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow a non-loopback host without API keys (e.g. behind an authenticating proxy)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(func=_serve)

    p = sub.add_parser("worker", help="run one worker process against PSGRAD_REDIS_URL")
    p.add_argument(
        "--device",
        default="auto",
        help="cuda:0, cuda, cpu or auto (CUDA when available); one per process",
    )
    p.set_defaults(func=_worker)

    try:
        from psgrad._cli_client import add_commands
    except ImportError:  # pragma: no cover - the client commands ship with the package
        pass
    else:
        add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "worker"):
        return int(args.func(args))
    from psgrad._cli_client import run

    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
