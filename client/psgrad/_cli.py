"""The ``psgrad`` command.

The client commands (:mod:`psgrad._cli_client`) need only the light SDK. A distribution that
registers a module under the ``psgrad.commands`` entry-point group adds its own commands: the
server (``psgrad-server``) adds ``serve`` and ``worker`` that way, so one ``psgrad`` command gains
the server's commands when the server is installed, and the client never imports the server.
Such a module has ``add_commands(subparsers)`` and ``run(args) -> int`` for the commands it added.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from types import ModuleType

from psgrad import __version__
from psgrad._cli_client import add_commands, run

PLUGIN_GROUP = "psgrad.commands"


def plugins() -> list[ModuleType]:
    """The command modules other installed distributions register (the server's)."""
    return [ep.load() for ep in entry_points(group=PLUGIN_GROUP)]


def build_parser(extra: Sequence[ModuleType] = ()) -> argparse.ArgumentParser:
    """The ``psgrad`` parser: the client commands and those of each module in ``extra``."""
    parser = argparse.ArgumentParser(
        prog="psgrad",
        description="Per-sample gradients as a service: run the server, or use "
        "one (PSGRAD_URL, PSGRAD_API_KEY).",
    )
    parser.add_argument("--version", action="version", version=f"psgrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in extra:
        before = set(sub.choices)
        module.add_commands(sub)
        for name in set(sub.choices) - before:
            sub.choices[name].set_defaults(plugin=module)
    add_commands(sub)
    return parser


SERVER_COMMANDS = ("serve", "worker")


def main(argv: Sequence[str] | None = None) -> int:
    extra = plugins()
    words = sys.argv[1:] if argv is None else list(argv)
    if not extra and words[:1] and words[0] in SERVER_COMMANDS:
        print(f"psgrad: '{words[0]}' is a command of the server, which is not installed here: "
              "from a checkout of psgrad, pip install torch==2.13.0 ./client .", file=sys.stderr)
        return 2
    args = build_parser(extra).parse_args(argv)
    plugin = getattr(args, "plugin", None)
    if plugin is not None:
        return int(plugin.run(args))
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
