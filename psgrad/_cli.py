"""The client side of the ``psgrad`` command.

The installed ``psgrad`` command is :func:`service.cli.main`: it adds ``serve`` and ``worker``
(the server) to the parser built here and hands every other command to the client commands
(:mod:`psgrad._cli_client`), which need only the light SDK. ``python -m psgrad._cli`` runs the
client commands alone, with nothing of the server imported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from psgrad._cli_client import add_commands, run

AddCommands = Callable[[Any], None]


def build_parser(server: AddCommands | None = None) -> argparse.ArgumentParser:
    """The ``psgrad`` parser: the client commands, and the server's when ``server`` adds them."""
    parser = argparse.ArgumentParser(
        prog="psgrad",
        description="Per-sample gradients as a service: run the server, or use "
        "one (PSGRAD_URL, PSGRAD_API_KEY).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if server is not None:
        server(sub)
    add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
