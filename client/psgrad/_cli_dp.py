"""``psgrad dp ...``: look at DP runs (``show``, ``list``) from a shell."""

from __future__ import annotations

import argparse
import json
from typing import Any

from psgrad._base import resource_path
from psgrad._cli_io import client_of


def add_dp_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    dp = sub.add_parser("dp", help="show DP-SGD runs: steps, epsilon, budget left",
                        description="DP-SGD runs on the server (POST /dp-runs makes them).")
    dsub = dp.add_subparsers(dest="dp_command", metavar="ACTION", required=True)
    p = dsub.add_parser("show", parents=[conn], help="one run: steps, epsilon under each "
                        "accountant, budget left (JSON)")
    p.add_argument("run", help="the run id (dp-...)")
    p.set_defaults(func=cmd_dp_show)
    p = dsub.add_parser("list", parents=[conn], help="every run (JSON lines)")
    p.set_defaults(func=cmd_dp_list)


def cmd_dp_show(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        doc = client._send("GET", resource_path("dp-runs", "DP run", args.run)).json()
        print(json.dumps(doc, indent=2))
    return 0


def cmd_dp_list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        for run in client._send("GET", "/dp-runs").json()["runs"]:
            print(json.dumps(run))
    return 0
